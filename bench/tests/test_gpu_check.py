"""make gpu-check on a machine without a GPU: it says what it would run and exits 0;
and its summary names every part's outcome, errors included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check, gpu_summary

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_without_a_gpu_it_prints_its_plan_and_exits_0(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"],
        cwd=ROOT,
        env={"GPU_CHECK_OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for parts, _ in gpu_check.GROUPS:
        for part in parts:
            assert part in done.stdout
    assert "no CUDA device here" in done.stdout
    assert not (tmp_path / "sections.jsonl").exists()  # nothing ran


def test_the_summary_reports_results_errors_and_timeouts(tmp_path):
    lines = [
        {"part": "env", "seconds": 0.1, "result": {"device": "NVIDIA H200", "capability": "9.0"}},
        {
            "part": "parity",
            "seconds": 3.0,
            "result": {"cases": 4, "equal": 3, "failures": {"block/x/input": {}}},
        },
        {"part": "gemm", "seconds": 1.0, "error": "Traceback ...\nRuntimeError: no kernel"},
        {"part": "cuda_graph+llama", "group_status": "timed out after 60 s"},
        {"part": "suite", "result": {"counts": {"passed": 9, "failed": 1}, "status": 1}},
    ]
    (tmp_path / "sections.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    gpu_summary.summarise(tmp_path)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "NVIDIA H200" in md
    assert "3/4 bit for bit" in md and "block/x/input" in md
    assert "ERROR: RuntimeError: no kernel" in md
    assert "timed out after 60 s" in md
    assert "'failed': 1" in md
    assert json.loads((tmp_path / "gpu_check.json").read_text())["gemm"]["seconds"] == 1.0


def test_the_gpu_tables_in_the_pages_are_what_the_committed_runs_render():
    """README.md and docs/cuda.md hold the tables bench.gpu_tables renders from
    bench/results/gpu (make readme); rendering again changes nothing."""
    from bench import gpu_tables

    runs = gpu_tables.load_runs()
    assert runs, "no committed gpu-check run"
    for page in gpu_tables.PAGES:
        text = page.read_text()
        assert "<!-- gpu:tests -->" in text
        assert gpu_tables.render(text, runs) == text, f"{page.name}: run make readme"


def test_each_table_cites_the_run_it_comes_from(tmp_path):
    from bench import gpu_tables

    old = {
        "env": {"result": {"commit": "aaa"}},
        "llama": {"result": {"shape": "s", "bf16_ms": 2.0}},
    }
    new = {"env": {"result": {"commit": "bbb"}}, "llama": {"result": None}}
    (tmp_path / "x-run1.json").write_text(json.dumps(old))
    (tmp_path / "x-run2.json").write_text(json.dumps(new))
    runs = gpu_tables.load_runs(tmp_path)
    assert [r["_file"] for r in runs] == ["x-run1.json", "x-run2.json"]
    lines = gpu_tables.llama_block(runs)
    assert "x-run1.json, fastcast aaa" in lines[0]  # the newest run that has the part
