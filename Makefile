# Two commands do all the set-up on a fresh machine: `make bench` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_TOOLS := $(VENV)/.bench
COMPARE := $(VENV)/.compare

.PHONY: kernels bench bench-check bench-sample bench-compare readme profile nsys test test-slow lint clean gpu-check

$(STAMP): pyproject.toml setup.py fastcast/runtime/_native.c
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned, so the CPU build on disk is used instead of a CUDA download.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

# The benchmark harness (pytest-benchmark, py-spy): the [bench] extra.
$(BENCH_TOOLS): $(STAMP)
	$(PY) -m pip install -e '.[bench]'
	touch $(BENCH_TOOLS)

# The peers the benchmarks compare against (torchao); optional: without them those
# entries are skipped, so a failed install does not stop the benchmarks.
$(COMPARE): $(BENCH_TOOLS)
	$(PY) -m pip install -e '.[compare]' || echo "torchao not installed: its comparisons are skipped"
	touch $(COMPARE)

# The fused C++ kernels: `pip install -e` above built them (setup.py); this says where
# they are and how long their build took, and builds them where the install did not
# (about 100 s on two cores, once per compiler, Python and torch). Without a compiler
# the reference path runs: said here, not an error.
kernels: $(STAMP)
	$(PY) -m fastcast.kernels || echo "fused kernels not built: the PyTorch reference path runs"

test: kernels
	$(PY) -m pytest tests bench/tests

# The minutes-long tests (marked slow): a wheel installed into a fresh environment,
# builds from an empty kernel directory, nvcc's compile check of the CUDA kernels, and the
# longest compile and multi-rank runs (.ci/run runs them after `make test`).
test-slow: kernels
	FASTCAST_SLOW_TESTS=1 $(PY) -m pytest tests bench/tests -m slow

bench: $(COMPARE) kernels
	$(PY) -m bench.run

# Every benchmark once, untimed (seconds): .ci/run's check that `make bench` runs.
bench-check: $(COMPARE) kernels
	$(PY) -m pytest bench -o python_files=bench_*.py --benchmark-disable -q -p no:cacheprovider

# Replace the committed bench/results/sample.json with this run's medians and overhead
# report, then README's tables and bench/charts/ from it (make bench itself changes no
# tracked file).
bench-sample: $(COMPARE) kernels
	$(PY) -m bench.run --update-sample
	$(MAKE) readme

# Per-call ratios of the last make bench against the one before (this machine's
# history in bench/results/history/); REGRESSION above THRESHOLD.
THRESHOLD ?= 1.10
bench-compare: $(BENCH_TOOLS)
	$(PY) -m bench.history --threshold $(THRESHOLD)

# README's benchmark tables and the charts it shows, from the committed sample.
readme: $(BENCH_TOOLS)
	$(PY) -m bench.readme
	$(PY) -m bench.gpu_tables
	$(PY) -m bench.charts --sample

# py-spy flamegraph (SVG) and speedscope JSON of the training step, in profiles/out/.
RECIPES ?= current
profile: $(BENCH_TOOLS) kernels
	PYTHON=$(PY) bash profiles/record.sh $(RECIPES)

# Nsight Systems trace with NVTX ranges and its per-range table (needs nsys and a GPU).
nsys: $(BENCH_TOOLS)
	PYTHON=$(PY) bash profiles/nsys.sh

# Everything fastcast must prove on a GPU (bench/gpu_check.py), with the machine's own
# CUDA torch (this .venv holds a CPU build): results in GPU_CHECK_OUT, within
# GPU_CHECK_BUDGET seconds. Without a GPU it prints what it would run and exits 0.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PYTHON) -m bench.gpu_check

lint: $(STAMP)
	$(VENV)/bin/ruff check fastcast tests bench

clean:
	rm -rf $(VENV) bench/results/*.json bench/results/charts
