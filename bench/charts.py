"""PNG charts of a benchmark run: ``python -m bench.charts [--sample | --results FILE ...]``.

Four charts, per-call medians (inner loops divided out, as in bench/run.py's tables):

- ``autocast.png``: ``fc.autocast`` enter+exit against an empty ``__slots__`` context
  manager, a ``@contextmanager`` generator and ``torch.autocast`` (and TransformerEngine's
  ``fp8_autocast`` when the run has it);
- ``linear.png``: ``fc.Linear`` fwd+bwd against ``nn.Linear`` and torchao's
  ``Float8Linear`` (16x16, overhead-bound);
- ``quantize.png``: quantize throughput per family at 4096x4096 (G elements/s);
- ``overhead.png``: the overhead report's per-range CPU time per step, split into kernel
  time and time outside kernels (bench/overhead_report.py).

``make bench`` draws them from ``bench/results/latest.json`` into
``bench/results/charts/``; ``--sample`` (``make readme``) from the committed
``bench/results/sample.json`` into ``bench/charts/``, which README shows. Entries a run
lacks (torchao not installed, say) are left out of their chart.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.report import RESULTS, ROOT, SAMPLE, Entry

SAMPLE_CHARTS = ROOT / "bench" / "charts"

# (chart file, benchmark group, title, [(test name, label), ...]) in the order drawn.
TIME_CHARTS = [
    (
        "autocast.png",
        "autocast enter+exit",
        "Context manager enter+exit, per call",
        [
            ("test_empty_slots_cm", "empty __slots__ CM"),
            ("test_slots_cm_storing_args", "__slots__ CM storing 4 args"),
            ("test_fc_autocast", "fc.autocast"),
            ("test_te_fp8_autocast", "TE fp8_autocast"),
            ("test_contextmanager_generator", "@contextmanager"),
            ("test_torch_autocast_cpu", "torch.autocast('cpu')"),
        ],
    ),
    (
        "linear.png",
        "linear-fwd-bwd",
        "Linear 16x16 forward+backward, per iteration",
        [
            ("test_nn_linear", "nn.Linear"),
            ("test_fc_linear_outside_autocast", "fc.Linear, no autocast"),
            ("test_fc_linear_current", "fc.Linear, current scaling"),
            ("test_fc_linear_delayed", "fc.Linear, delayed scaling"),
            ("test_torchao_float8_linear", "torchao Float8Linear"),
        ],
    ),
]
QUANTIZE_GROUP = "quantize-4096"


def _plt():
    try:
        import matplotlib  # noqa: PLC0415 - optional: the [bench] extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print(
            "bench.charts: matplotlib is not installed (pip install -e '.[bench]'); "
            "no charts drawn",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    return plt


def _barh(plt, labels: list[str], values: list[float], unit: str, title: str, path: Path):
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.2))
    bars = ax.barh(labels, values, color="#4c72b0")
    ax.invert_yaxis()  # first entry on top
    ax.bar_label(bars, labels=[f"{v:.3g} {unit}" for v in values], padding=3, fontsize=8)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _scaled(seconds: list[float]) -> tuple[list[float], str]:
    biggest = max(seconds)
    for unit, scale in (("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3)):
        if biggest < 1000 * scale:
            return [s / scale for s in seconds], unit
    return seconds, "s"


def draw(results: dict, overhead: dict | None, out: Path) -> list[Path]:
    """Draw every chart the data allows into ``out``; return the files written."""
    plt = _plt()
    out.mkdir(parents=True, exist_ok=True)
    entries = [Entry(b) for b in results.get("benchmarks", [])]
    by_name = {(e.group, e.name): e for e in entries}
    written = []
    for filename, group, title, members in TIME_CHARTS:
        present = [(by_name[(group, n)], label) for n, label in members if (group, n) in by_name]
        if not present:
            continue
        values, unit = _scaled([e.median for e, _ in present])
        _barh(plt, [label for _, label in present], values, unit, title, out / filename)
        written.append(out / filename)

    quantize = sorted(
        (e for e in entries if e.group == QUANTIZE_GROUP and "numel" in e.extra),
        key=lambda e: e.name,
    )
    if quantize:
        labels = [e.name.removeprefix("test_") for e in quantize]
        rates = [e.extra["numel"] / e.median / 1e9 for e in quantize]
        title = "Quantize 4096x4096 FP32 (plain_cast: x.to(float8_e4m3fn))"
        _barh(plt, labels, rates, "G elements/s", title, out / "quantize.png")
        written.append(out / "quantize.png")

    if overhead and overhead.get("ranges"):
        rows = overhead["ranges"]
        labels = [r["range"].removeprefix("fastcast.") for r in rows]
        kernel = [r["kernel_us_per_call"] * r["calls_per_step"] / 1000 for r in rows]
        outside = [r["cpu_us_per_step"] / 1000 - k for r, k in zip(rows, kernel)]
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.4))
        ax.barh(labels, kernel, color="#4c72b0", label="kernels")
        ax.barh(labels, outside, left=kernel, color="#dd8452", label="outside kernels")
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (ranges nest: rows do not add up)")
        step = overhead["step"]
        ax.set_title(
            f"Per-range CPU time, recipe {overhead.get('recipe', '?')} on "
            f"{overhead.get('device', '?')}: step {step['cpu_us'] / 1000:.1f} ms, "
            f"kernels {step['kernel_us'] / 1000:.1f} ms",
            fontsize=10,
        )
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(out / "overhead.png", dpi=100)
        plt.close(fig)
        written.append(out / "overhead.png")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.charts", description=__doc__)
    p.add_argument("--sample", action="store_true", help="from sample.json into bench/charts/")
    p.add_argument("--results", type=Path, default=RESULTS / "latest.json")
    p.add_argument("--overhead", type=Path, default=None, help="an overhead report JSON")
    p.add_argument("--out", type=Path, default=RESULTS / "charts")
    args = p.parse_args(argv)
    results_path = SAMPLE if args.sample else args.results
    out = SAMPLE_CHARTS if args.sample else args.out
    if not results_path.exists():
        print(f"bench.charts: no {results_path}; run `make bench` first", file=sys.stderr)
        return 2
    results = json.loads(results_path.read_text())
    overhead = (results.get("fastcast") or {}).get("overhead")
    if args.overhead is not None and args.overhead.exists():
        overhead = json.loads(args.overhead.read_text())
    for path in draw(results, overhead, out):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
