"""The overhead report's per-range table from an Nsight Systems trace: ``make nsys``.

Two modes:

- ``python -m bench.nsys_report --run [--recipe current --steps 10]``: the program nsys
  records. It trains bench/train_step.py's model (bench/overhead_report.py's step) with
  fastcast's ranges on, and wraps each profiled step in the NVTX range
  ``overhead_report.step`` (domain ``fastcast``), so that the trace has the steps too.
- ``python -m bench.nsys_report REPORT.nsys-rep --steps 10``: runs ``nsys stats`` for the
  ``nvtx_sum`` (CPU duration of each range), ``nvtx_gpu_proj_sum`` (the GPU time of the
  work each range launched, projected onto the range) and ``cuda_gpu_kern_sum`` reports
  as CSV next to the trace, and prints the same table as the overhead report: calls per
  step, CPU µs per call, kernel µs per call (the GPU projection), their ratio, and the
  per-step totals and verdict; then the kernels by total time.

The CSV columns are found by name (``Range``/``Name``, ``Instances``, ``Avg (ns)``,
``Proj Avg (ns)``...), so that nsys versions that reorder them still parse.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.overhead_report import PREFIX, STEP, WARMUP, format_report, range_key

REPORTS = ("nvtx_sum", "nvtx_gpu_proj_sum", "cuda_gpu_kern_sum")


def _column(header: Sequence[str], *candidates: str) -> str | None:
    """The first column whose lower-cased name equals, then contains, a candidate."""
    lowered = {h.lower().strip(): h for h in header}
    for c in candidates:
        if c in lowered:
            return lowered[c]
    for c in candidates:
        for low, h in lowered.items():
            if c in low:
                return h
    return None


def _number(text: str | None) -> float:
    return float(text.replace(",", "")) if text not in (None, "") else 0.0


def _range_name(text: str) -> str:
    """``fastcast:fastcast.scaled_mm`` or ``:fastcast.scaled_mm`` -> ``fastcast.scaled_mm``
    (nsys prefixes the domain), and the step range likewise."""
    for marker in (PREFIX, STEP):
        at = text.find(marker)
        if at >= 0:
            return text[at:]
    return text


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def summarize(
    nvtx: list[dict[str, str]], projection: list[dict[str, str]], steps: int, per_module: bool
) -> dict[str, Any]:
    """overhead_report's dict (device ``cuda``) from the two NVTX reports' rows."""
    if steps < 1:
        raise ValueError(f"nsys_report: steps must be at least 1, got {steps}")
    totals: dict[str, dict[str, float]] = {}

    def add(rows: list[dict[str, str]], calls_key: tuple[str, ...], time_key: tuple[str, ...],
            field: str) -> None:  # fmt: skip
        if not rows:
            return
        header = list(rows[0])
        name_col = _column(header, "range", "name")
        calls_col = _column(header, *calls_key)
        time_col = _column(header, *time_key)
        if name_col is None or calls_col is None or time_col is None:
            raise ValueError(f"nsys_report: unexpected columns {header}")
        for row in rows:
            name = _range_name(row[name_col])
            if not (name.startswith(PREFIX) or name == STEP):
                continue
            key = name if name == STEP else range_key(name, per_module)
            entry = totals.setdefault(key, {"calls": 0.0, "cpu_ns": 0.0, "gpu_ns": 0.0})
            calls = _number(row[calls_col])
            if field == "cpu_ns":
                entry["calls"] += calls
            entry[field] += _number(row[time_col])

    add(nvtx, ("instances",), ("total time (ns)", "total time"), "cpu_ns")
    add(
        projection,
        ("range instances", "instances"),
        ("total proj time (ns)", "proj time"),
        "gpu_ns",
    )
    step = totals.pop(STEP, None)
    rows = []
    for name in sorted(totals, key=lambda k: -totals[k]["cpu_ns"]):
        t = totals[name]
        calls = t["calls"] or 1.0
        rows.append(
            {
                "range": name,
                "calls_per_step": t["calls"] / steps,
                "cpu_us_per_call": t["cpu_ns"] / calls / 1e3,
                "kernel_us_per_call": t["gpu_ns"] / calls / 1e3,
                "cpu_over_kernel": t["cpu_ns"] / t["gpu_ns"] if t["gpu_ns"] > 0 else None,
                "cpu_us_per_step": t["cpu_ns"] / steps / 1e3,
            }
        )
    cpu = step["cpu_ns"] / max(step["calls"], 1) / 1e3 if step else 0.0
    gpu = step["gpu_ns"] / max(step["calls"], 1) / 1e3 if step else 0.0
    return {
        "device": "cuda",
        "steps": int(step["calls"]) if step else steps,
        "ranges": rows,
        "step": {
            "cpu_us": cpu,
            "kernel_us": gpu,
            "outside_kernels_us": cpu - gpu,
            "cpu_over_kernel": cpu / gpu if gpu > 0 else None,
            "cpu_bound": cpu > gpu,
        },
    }


def stats(rep: Path) -> dict[str, Path]:
    """Run ``nsys stats`` for ``REPORTS`` as CSV next to ``rep``; the files by report."""
    prefix = rep.with_suffix("")
    cmd = ["nsys", "stats", "--force-export=true", "--format", "csv", "--output", str(prefix)]
    cmd += ["--report", ",".join(REPORTS), str(rep)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return {r: Path(f"{prefix}_{r}.csv") for r in REPORTS}


def kernels_table(rows: list[dict[str, str]], top: int = 10) -> list[str]:
    if not rows:
        return []
    header = list(rows[0])
    name = _column(header, "name")
    total = _column(header, "total time (ns)", "total time")
    count = _column(header, "instances")
    if name is None or total is None or count is None:
        return []
    ranked = sorted(rows, key=lambda r: -_number(r[total]))[:top]
    lines = ["", f"kernels by total time (top {len(ranked)}):"]
    for r in ranked:
        lines.append(
            f"  {_number(r[total]) / 1e3:12,.1f} µs  {int(_number(r[count])):6d}x  {r[name][:90]}"
        )
    return lines


def run(recipe: str, steps: int) -> None:
    """The recorded program: WARMUP steps, then ``steps`` steps in NVTX step ranges."""
    import nvtx  # noqa: PLC0415 - a dependency of fastcast, used when tracing
    import torch  # noqa: PLC0415

    import fastcast as fc  # noqa: PLC0415
    from bench.overhead_report import training_step  # noqa: PLC0415
    from bench.train_step import DEFAULTS  # noqa: PLC0415

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step = training_step(
        recipe, DEFAULTS["width"], DEFAULTS["depth"], DEFAULTS["batch"], WARMUP + steps, device
    )
    fc.profiling.enable()
    for i in range(WARMUP):
        step(i)
    for i in range(WARMUP, WARMUP + steps):
        with nvtx.annotate(STEP, domain="fastcast"):
            step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.nsys_report", description=__doc__)
    p.add_argument("report", nargs="?", type=Path, help="an .nsys-rep file")
    p.add_argument("--run", action="store_true", help="be the program nsys records")
    p.add_argument("--recipe", default="current")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--per-module", action="store_true")
    args = p.parse_args(argv)
    if args.run:
        run(args.recipe, args.steps)
        return 0
    if args.report is None:
        p.error("give an .nsys-rep file, or --run")
    files = stats(args.report)
    missing = [str(f) for f in files.values() if not f.exists()]
    if missing:
        print(f"nsys_report: nsys stats wrote no {', '.join(missing)}", file=sys.stderr)
    nvtx = read_csv(files["nvtx_sum"]) if files["nvtx_sum"].exists() else []
    proj = read_csv(files["nvtx_gpu_proj_sum"]) if files["nvtx_gpu_proj_sum"].exists() else []
    result = summarize(nvtx, proj, args.steps, args.per_module)
    from bench.train_step import DEFAULTS  # noqa: PLC0415

    result.update(
        recipe=args.recipe, width=DEFAULTS["width"], depth=DEFAULTS["depth"],
        batch=DEFAULTS["batch"],
    )  # fmt: skip
    print("\n".join(format_report(result)))
    kern = files["cuda_gpu_kern_sum"]
    print("\n".join(kernels_table(read_csv(kern) if kern.exists() else [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
