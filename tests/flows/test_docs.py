"""Every code block of README.md and docs/*.md runs as written.

Python blocks run in a fresh namespace each, in this process, in the order they appear
in their file (a block may use what an earlier block of the same file defined, as a
reader following the page would); the blocks of a script run by torchrun (``TORCHRUN``)
run under torchrun in test_docs_torchrun.py. Shell blocks name `make` targets and `python -m`
modules: those must exist.
"""

from __future__ import annotations

import re
import runpy
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


# A block that is (part of) a script run by torchrun starts with "# name.py: torchrun
# --nproc-per-node N name.py" or "# name.py, continued": test_docs_torchrun.py runs them.
TORCHRUN = re.compile(r"# (\w+\.py)(?:: torchrun --nproc-per-node (\d+) \1|, continued)\b")


def torchrun_scripts(page: Path) -> dict[str, tuple[int, str]]:
    """The page's torchrun scripts by name: the process count its first block names, and
    its blocks joined in order."""
    scripts: dict[str, tuple[int, str]] = {}
    for body in blocks(page, "python"):
        found = TORCHRUN.match(body)
        if found is None:
            continue
        name, nproc = found.groups()
        if nproc is not None:
            assert name not in scripts, f"{page.name}: {name} starts twice"
            scripts[name] = (int(nproc), body)
        else:
            assert name in scripts, f"{page.name}: {name} continued before it starts"
            count, code = scripts[name]
            scripts[name] = (count, code + "\n" + body)
    return scripts


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(page, tmp_path, monkeypatch):
    code = [body for body in blocks(page, "python") if not TORCHRUN.match(body)]
    if not code:
        pytest.skip("no python block")
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace: dict = {"__name__": "__doc_example__"}
    for i, body in enumerate(code):
        script = tmp_path / f"block{i}.py"
        script.write_text(body)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a block's own warnings are its business
            namespace = runpy.run_path(str(script), init_globals=namespace)


def test_shell_blocks_name_real_targets():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", makefile, re.M))
    for page in PAGES:
        for body in blocks(page, "bash"):
            for target in re.findall(r"^make ([\w-]+)", body, re.M):
                assert target in targets, f"{page.name}: make {target} is not a Makefile target"
            for module in re.findall(r"python -m ([\w.]+)", body):
                path = ROOT / Path(*module.split("."))
                assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), (
                    f"{page.name}: python -m {module} names no module of this repository"
                )


# Pages whose file citations are checked (the checkpoint and security pages; their
# citations once named modules that had been split and removed).
CITING_PAGES = ["checkpoints.md", "loads.md", "security.md"]
CITED_PATH = re.compile(r"`((?:fastcast|tests|bench)/[\w./-]+)`")


@pytest.mark.parametrize("name", CITING_PAGES)
def test_cited_files_exist(name):
    page = ROOT / "docs" / name
    cited = CITED_PATH.findall(page.read_text())
    missing = [path for path in cited if not (ROOT / path).exists()]
    assert not missing, f"docs/{name} cites files that do not exist: {missing}"
