# Two commands do all the set-up on a fresh machine: `make bench` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: bench test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned, so the CPU build on disk is used instead of a CUDA download.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) -m bench.run

lint: $(STAMP)
	$(VENV)/bin/ruff check fastcast tests bench

clean:
	rm -rf $(VENV) bench/results/*.json
