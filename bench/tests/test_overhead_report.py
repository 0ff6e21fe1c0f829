"""bench/overhead_report.py: per-range CPU time against kernel time, on a tiny model."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level package of the repository
    sys.path.insert(0, str(ROOT))

import fastcast as fc  # noqa: E402
from bench import overhead_report  # noqa: E402

DEPTH = 2
LAYERS = 2 * DEPTH + 1  # fc1 and fc2 per block, and the head


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[dict, Path]:
    trace = tmp_path_factory.mktemp("overhead") / "trace.json"
    result = overhead_report.report(
        "delayed", steps=2, width=32, depth=DEPTH, batch=32, device="cpu", trace=trace
    )
    return result, trace


def test_report_has_every_range_with_consistent_numbers(tiny):
    result, trace = tiny
    assert not fc.profiling.is_enabled()  # the report leaves tracing as it found it
    assert result["steps"] == 2 and result["device"] == "cpu"
    rows = {r["range"]: r for r in result["ranges"]}
    assert rows["fastcast.Linear.forward"]["calls_per_step"] == LAYERS
    assert rows["fastcast.Linear.backward"]["calls_per_step"] == LAYERS
    assert rows["fastcast.autocast.enter"]["calls_per_step"] == 1
    assert rows["fastcast.amax_update"]["calls_per_step"] == 2  # forward and backward
    # Forward, dgrad and wgrad GEMMs per layer (every input comes out of a LayerNorm
    # or a GELU, so every layer needs its dgrad).
    assert rows["fastcast.scaled_mm"]["calls_per_step"] == 3 * LAYERS
    for r in result["ranges"]:
        # On CPU the operators' self time is part of the range's own time.
        assert 0 <= r["kernel_us_per_call"] <= r["cpu_us_per_call"], r
        assert r["cpu_us_per_step"] == pytest.approx(r["calls_per_step"] * r["cpu_us_per_call"])
        if r["kernel_us_per_call"] > 0:
            assert r["cpu_over_kernel"] == pytest.approx(
                r["cpu_us_per_call"] / r["kernel_us_per_call"]
            )
    step = result["step"]
    assert 0 < step["kernel_us"] <= step["cpu_us"]
    assert step["outside_kernels_us"] == pytest.approx(step["cpu_us"] - step["kernel_us"])
    assert step["cpu_bound"] == (step["outside_kernels_us"] > step["kernel_us"])
    # Forward and backward ranges do not nest in each other: together they fit in a step.
    linear = sum(rows[f"fastcast.Linear.{p}"]["cpu_us_per_step"] for p in ("forward", "backward"))
    assert linear <= step["cpu_us"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "fastcast.Linear.forward[blocks.0.fc1]" for e in events)


def test_printed_tables(tiny):
    result, _ = tiny
    lines = overhead_report.format_report(result)
    header = lines[1].split("  ")
    for column in ("range", "calls/step", "CPU µs/call", "ATen µs/call", "CPU/kernel"):
        assert column in [h.strip() for h in header if h.strip()], header
    assert any(line.startswith("fastcast.scaled_mm") for line in lines)
    assert lines[-1].startswith("per step: CPU side")


@dataclass
class FakeEvent:
    name: str
    cpu_time_total: float
    self_cpu_time_total: float = 0.0
    device_time_total: float = 0.0
    cpu_children: list = field(default_factory=list)


def test_cuda_kernel_time_is_the_device_time_and_decides_the_verdict():
    # Two steps: one range with a kernel of 30 µs on the device but 100 µs of CPU.
    events = []
    for _ in range(2):
        op = FakeEvent("aten::mm", 20, 20, device_time_total=30)
        rng = FakeEvent("fastcast.scaled_mm", 100, 80, device_time_total=30, cpu_children=[op])
        step = FakeEvent("overhead_report.step", 150, 50, device_time_total=30, cpu_children=[rng])
        events += [step, rng, op]
    result = overhead_report.summarize(events, cuda=True)
    (row,) = result["ranges"]
    assert row["calls_per_step"] == 1 and row["kernel_us_per_call"] == 30
    assert row["cpu_over_kernel"] == pytest.approx(100 / 30)
    assert result["step"]["cpu_bound"]  # 150 µs to launch 30 µs of kernels
    quick = [FakeEvent("overhead_report.step", 10, 10, device_time_total=30)]
    assert not overhead_report.summarize(quick, cuda=True)["step"]["cpu_bound"]


def test_cpu_kernel_time_counts_operator_self_time_only():
    # aten::linear (self 5) -> aten::addmm (self 40); an autograd scope is not an operator.
    addmm = FakeEvent("aten::addmm", 40, 40)
    linear = FakeEvent("aten::linear", 45, 5, cpu_children=[addmm])
    scope = FakeEvent("autograd::engine::evaluate_function: X", 60, 15, cpu_children=[linear])
    rng = FakeEvent("fastcast.Linear.backward[fc]", 100, 40, cpu_children=[scope])
    assert overhead_report.kernel_us(rng, cuda=False) == 45
    per_module = overhead_report.summarize([rng], cuda=False, per_module=True)
    assert per_module["ranges"][0]["range"] == "fastcast.Linear.backward[fc]"
    grouped = overhead_report.summarize([rng], cuda=False)
    assert grouped["ranges"][0]["range"] == "fastcast.Linear.backward"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown recipe 'fp32'"):
        overhead_report.report("fp32")
    with pytest.raises(ValueError, match="steps must be at least 1"):
        overhead_report.report("current", steps=0)
