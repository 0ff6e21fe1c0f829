"""Per-range CPU time against kernel time of training steps, under ``torch.profiler``.

``python -m bench.overhead_report [--recipe current --steps 10 --per-module ...]`` trains
bench/train_step.py's model (same model, data and optimizer) with fastcast's ranges on
(``fc.profiling.enable()``), profiles ``--steps`` steps after a warm-up, and prints per
range (``fastcast.Linear.forward``, ``fastcast.quantizers.*``, ``fastcast.scaled_mm``, ...):

- calls per step, CPU µs per call (the range's wall time on the CPU thread);
- kernel µs per call. On CUDA: the device time of the kernels launched inside the range
  (torch.profiler links them by correlation id). On CPU, where the CPU is the device:
  the self time of the operators dispatched inside the range (``aten::*``,
  ``fastcast_kernels::*``), so that CPU minus kernel is the Python and dispatch cost
  around them, fastcast's and PyTorch's;
- CPU/kernel: 1x is a range whose every microsecond is kernel work.

and per step: the CPU-side total (the step's wall time on the CPU thread), the
device-side total (kernel time as above) and a verdict. On CUDA a step is CPU-bound when
its CPU side takes longer than its kernels (the GPU then waits for launches). On CPU
the verdict says whether the time outside kernels exceeds the kernel time (the step is
overhead-bound). Ranges nest (quantize and GEMM ranges are inside Linear's), so the
rows do not add up to the step.

Writes ``profiles/out/overhead_<recipe>.json`` (the tables' numbers) and
``profiles/out/overhead_<recipe>.trace.json`` (a Chrome trace: chrome://tracing or
https://ui.perfetto.dev). ``report()`` is the API tests call.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

import fastcast as fc
from bench.train_step import DEFAULTS, QUANTIZED, MLPStack, make_data

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "profiles" / "out"
STEP = "overhead_report.step"  # the step's own scope (not a fastcast range)
PREFIX = "fastcast."  # fastcast's ranges; its operators are "fastcast_kernels::..."
WARMUP = 3


class Event(Protocol):
    """What the report reads of a ``torch.autograd.profiler_util.FunctionEvent``."""

    name: str
    cpu_time_total: float  # µs, children included
    self_cpu_time_total: float  # µs, children excluded
    device_time_total: float  # µs of the kernels launched inside, children included
    cpu_children: list[Any]


# --------------------------------------------------------------------------- measuring


def is_operator(name: str) -> bool:
    """An operator the dispatcher ran (``aten::mm``, ``fastcast_kernels::...``), as
    opposed to a scope (``autograd::engine::...`` and ``profiler::`` scopes hold some)."""
    return "::" in name and not name.startswith(("autograd::", "profiler::"))


def kernel_us(event: Event, cuda: bool) -> float:
    """The kernel time inside ``event``, in µs (see the module docstring)."""
    if cuda:
        return float(event.device_time_total)
    total, stack = 0.0, list(event.cpu_children)
    while stack:
        child = stack.pop()
        if is_operator(child.name):
            total += child.self_cpu_time_total
        stack.extend(child.cpu_children)
    return total


def range_key(name: str, per_module: bool) -> str:
    """``fastcast.Linear.forward[blocks.0.fc1]`` -> ``fastcast.Linear.forward`` unless
    ranges are kept per module."""
    return name if per_module else name.split("[", 1)[0]


def summarize(
    events: Iterable[Event], cuda: bool, per_module: bool = False, step_name: str = STEP
) -> dict[str, Any]:
    """The report's numbers from profiler events (every event, nested ones included)."""
    ranges: dict[str, dict[str, float]] = {}
    steps: list[dict[str, float]] = []
    for event in events:
        if event.name == step_name:
            steps.append({"cpu_us": event.cpu_time_total, "kernel_us": kernel_us(event, cuda)})
        elif event.name.startswith(PREFIX):
            row = ranges.setdefault(
                range_key(event.name, per_module), {"calls": 0, "cpu_us": 0.0, "kernel_us": 0.0}
            )
            row["calls"] += 1
            row["cpu_us"] += event.cpu_time_total
            row["kernel_us"] += kernel_us(event, cuda)
    n = max(len(steps), 1)
    rows = []
    for name in sorted(ranges, key=lambda k: -ranges[k]["cpu_us"]):
        r = ranges[name]
        rows.append(
            {
                "range": name,
                "calls_per_step": r["calls"] / n,
                "cpu_us_per_call": r["cpu_us"] / r["calls"],
                "kernel_us_per_call": r["kernel_us"] / r["calls"],
                "cpu_over_kernel": _ratio(r["cpu_us"], r["kernel_us"]),
                "cpu_us_per_step": r["cpu_us"] / n,
            }
        )
    cpu_total = sum(s["cpu_us"] for s in steps) / n
    kernel_total = sum(s["kernel_us"] for s in steps) / n
    if cuda:  # the GPU waits for launches when the CPU side takes longer
        cpu_bound = cpu_total > kernel_total
    else:  # the CPU is the device: overhead-bound when most of the step is not kernels
        cpu_bound = cpu_total - kernel_total > kernel_total
    return {
        "device": "cuda" if cuda else "cpu",
        "steps": len(steps),
        "ranges": rows,
        "step": {
            "cpu_us": cpu_total,
            "kernel_us": kernel_total,
            "outside_kernels_us": cpu_total - kernel_total,
            "cpu_over_kernel": _ratio(cpu_total, kernel_total),
            "cpu_bound": cpu_bound,
        },
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def training_step(
    recipe: str, width: int, depth: int, batch: int, steps: int, device: torch.device
) -> Callable[[int], None]:
    """``step(i)``: one training step of train_step's model on batch ``i`` (of ``steps``),
    the forward under ``fc.autocast(recipe=...)``, as bench/train_step.py runs it."""
    torch.manual_seed(0)
    model = MLPStack(width, depth).to(device)
    fc.convert(model, recipe=QUANTIZED[recipe]())
    autocast_recipe = QUANTIZED[recipe]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULTS["lr"])
    inputs, targets = make_data(width, batch, steps, 0, device)

    def step(i: int) -> None:
        with fc.autocast(recipe=autocast_recipe):
            out = model(inputs[i])
        F.mse_loss(out.float(), targets[i]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def report(
    recipe: str = "current",
    steps: int = 10,
    width: int = DEFAULTS["width"],
    depth: int = DEFAULTS["depth"],
    batch: int = DEFAULTS["batch"],
    device: str | None = None,
    per_module: bool = False,
    trace: Path | None = None,
) -> dict[str, Any]:
    """Profile ``steps`` training steps of ``recipe`` (one of train_step's quantized
    recipes) after ``WARMUP`` unprofiled ones; return ``summarize``'s dict plus the run's
    settings. ``trace``: where to write the Chrome trace."""
    if recipe not in QUANTIZED:
        raise ValueError(
            f"overhead_report: unknown recipe {recipe!r}; choose from {list(QUANTIZED)}"
        )
    if steps < 1:
        raise ValueError(f"overhead_report: steps must be at least 1, got {steps}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    step = training_step(recipe, width, depth, batch, WARMUP + steps, dev)

    was_enabled = fc.profiling.is_enabled()
    fc.profiling.enable()
    try:
        for i in range(WARMUP):
            step(i)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize(dev)
        with profile(activities=activities) as prof:
            for i in range(WARMUP, WARMUP + steps):
                with record_function(STEP):
                    step(i)
            if cuda:
                torch.cuda.synchronize(dev)
    finally:
        if not was_enabled:
            fc.profiling.disable()
    result = summarize(prof.events(), cuda, per_module)
    result.update(
        recipe=recipe, width=width, depth=depth, batch=batch, torch=torch.__version__,
        threads=torch.get_num_threads(), datetime=datetime.now(timezone.utc).isoformat(),
    )  # fmt: skip
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    return result


# --------------------------------------------------------------------------- printing


def _us(value: float) -> str:
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def format_report(result: dict[str, Any]) -> list[str]:
    """The two tables as text lines."""
    cuda = result["device"] == "cuda"
    kernel = "kernel µs/call" if cuda else "ATen µs/call"
    headers = ["range", "calls/step", "CPU µs/call", kernel, "CPU/kernel", "CPU µs/step"]
    rows = [
        [
            r["range"],
            f"{r['calls_per_step']:g}",
            _us(r["cpu_us_per_call"]),
            _us(r["kernel_us_per_call"]),
            "-" if r["cpu_over_kernel"] is None else f"{r['cpu_over_kernel']:.2f}x",
            _us(r["cpu_us_per_step"]),
        ]
        for r in result["ranges"]
    ]
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    s = result["step"]
    device_side = "device (kernels)" if cuda else "kernels (ATen self time)"
    if cuda:
        verdict = "CPU-bound: the GPU waits for launches" if s["cpu_bound"] else "GPU-bound"
    else:
        verdict = (
            "overhead-bound: most of the step is outside kernels"
            if s["cpu_bound"]
            else "compute-bound: most of the step is kernels"
        )
    ratio = "-" if s["cpu_over_kernel"] is None else f"{s['cpu_over_kernel']:.2f}x"
    return [
        f"overhead report: recipe {result.get('recipe', '?')}, {result['steps']} steps, "
        f"device {result['device']}, width {result.get('width')}, depth {result.get('depth')}, "
        f"batch {result.get('batch')}",
        line(headers),
        line(["-" * w for w in widths]),
        *(line(r) for r in rows),
        "",
        f"per step: CPU side {_us(s['cpu_us'])} µs, {device_side} {_us(s['kernel_us'])} µs, "
        f"outside kernels {_us(s['outside_kernels_us'])} µs (CPU/kernel {ratio}): {verdict}",
    ]


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead_report", description=__doc__)
    p.add_argument("--recipe", default="current", choices=list(QUANTIZED))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=DEFAULTS["width"])
    p.add_argument("--depth", type=int, default=DEFAULTS["depth"])
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--per-module", action="store_true", help="one row per Linear module")
    p.add_argument("--out", type=Path, default=OUT, help="folder for the JSON and the trace")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (0: torch's)")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    trace = args.out / f"overhead_{args.recipe}.trace.json"
    started = time.perf_counter()
    result = report(
        args.recipe, args.steps, args.width, args.depth, args.batch, args.device,
        args.per_module, trace,
    )  # fmt: skip
    print("\n".join(format_report(result)))
    path = args.out / f"overhead_{args.recipe}.json"
    path.write_text(json.dumps(_json_safe(result), indent=1) + "\n")
    print(f"wrote {_shown(path)} and {_shown(trace)} ({time.perf_counter() - started:.1f} s)")
    return 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
