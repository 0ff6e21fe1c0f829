"""The harness's shared layer: result paths, the per-call view of a pytest-benchmark
result (``Entry``), number formatting and the text/Markdown tables of a run.

``run`` (``make bench``), ``history`` (``make bench-compare``), ``readme`` and ``charts``
import it; it imports none of them (nothing in bench/ imports ``run``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
LATEST = RESULTS / "latest.json"
SAMPLE = RESULTS / "sample.json"
SUMMARY = RESULTS / "summary.md"
CHARTS = RESULTS / "charts"
OVERHEAD = ROOT / "profiles" / "out" / "overhead_current.json"  # bench/overhead_report.py
# bench/train_step.py --json: eager and compiled training steps (README's tables).
TRAIN_STEP = RESULTS / "train_step.json"
TRAIN_COMPILE = RESULTS / "train_step_compile.json"
# bench.train_step --compile: a compiled FP8/FP4 step at most this fraction of its eager
# step; the recipes it does not apply to (high precision, the peer).
COMPILE_TARGET = 0.6
HIGH_PRECISION = ("fp32", "bf16", "torchao")


# --------------------------------------------------------------------------- formatting


def format_time(seconds: float) -> str:
    """A duration with three significant digits in ns, µs, ms or s."""
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds == 0:
        return "0 ns"
    for unit, scale in (("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3)):
        if abs(seconds) < 1000 * scale * (1 - 5e-4):  # would print as 1000 otherwise
            return _three_digits(seconds / scale, unit)
    return _three_digits(seconds, "s")


def _three_digits(value: float, unit: str) -> str:
    magnitude = math.floor(math.log10(abs(value))) if value else 0
    decimals = max(0, 2 - magnitude)
    text = f"{value:.{decimals}f}"
    if decimals and float(text) >= 10 ** (magnitude + 1):  # rounding added a digit
        text = f"{value:.{decimals - 1}f}"
    return f"{text} {unit}"


def format_ratio(ratio: float) -> str:
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "n/a"


def format_bytes(size: object) -> str:
    """A byte count in full, with thousands separators (sizes compared at 1.1x need
    every digit); empty when not recorded."""
    return "" if size is None else f"{int(size):,}"


def text_table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def md_escape(cell: str) -> str:
    """Escape the characters Markdown would read as table or emphasis syntax."""
    for char in "\\|_*`":
        cell = cell.replace(char, "\\" + char)
    return cell


def md_table(
    headers: list[str], rows: list[list[str]], right: set[int], raw: frozenset[int] = frozenset()
) -> list[str]:
    """A Markdown table; cells of the ``raw`` columns are already Markdown."""
    align = ["---:" if i in right else "---" for i in range(len(headers))]
    return [
        "| " + " | ".join(md_escape(h) for h in headers) + " |",
        "| " + " | ".join(align) + " |",
        *(
            "| " + " | ".join(c if i in raw else md_escape(c) for i, c in enumerate(r)) + " |"
            for r in rows
        ),
    ]


# --------------------------------------------------------------------------- report


class Entry:
    """One benchmark, its statistics scaled to one inner iteration."""

    def __init__(self, raw: dict) -> None:
        self.name: str = raw["name"]
        # "bench/bench_x.py::test_y[p]" -> "bench.bench_x", the module's import name
        path = raw.get("fullname", "").split("::")[0]
        self.module = path.removesuffix(".py").replace("/", ".").replace("\\", ".")
        self.group: str = raw.get("group") or "(no group)"
        self.inner = int((raw.get("extra_info") or {}).get("inner", 1)) or 1
        stats = raw["stats"]
        self.median = stats["median"] / self.inner
        self.iqr = stats["iqr"] / self.inner
        self.rounds = int(stats["rounds"])
        self.extra = raw.get("extra_info") or {}

    def metric(self, name: str) -> float:
        """The median time, or a number the benchmark recorded in extra_info."""
        return self.median if name == "median" else float(self.extra.get(name, math.nan))


def _format_count(value: object) -> str:
    return "" if value is None else f"{value:g}"


# extra_info keys shown as a column of their group's table: (header, format).
EXTRA_COLUMNS = {"bytes": ("bytes", format_bytes), "aten_ops": ("ATen ops", _format_count)}


def spread(entry: Entry) -> float:
    """How noisy a benchmark's rounds were: IQR over median (0.1 = 10%)."""
    return entry.iqr / entry.median if entry.median > 0 else math.inf


def format_spread(entry: Entry) -> str:
    return f"{spread(entry):.0%}"


# A benchmark whose rounds spread wider than this is called noisy in the run's summary.
NOISY_SPREAD = 0.10


def noise_summary(entries: list[Entry]) -> str:
    """One line on how noisy the run was: the spread (IQR / median) of its benchmarks,
    naming the noisiest. On a loaded machine rounds cluster at multiples of the
    scheduler's time slice, which shows here before it shows in the medians."""
    ranked = sorted(entries, key=spread, reverse=True)
    spreads = sorted(spread(e) for e in entries)
    median = spreads[len(spreads) // 2]
    noisy = [e for e in ranked if spread(e) > NOISY_SPREAD]
    line = (
        f"run noise: spread (IQR / median) {median:.0%} for the median benchmark; "
        f"{len(noisy)} of {len(entries)} above {NOISY_SPREAD:.0%}"
    )
    if noisy:
        line += ": " + ", ".join(f"{e.name} {spread(e):.0%}" for e in noisy[:5])
        line += ", ..." if len(noisy) > 5 else ""
        line += " (a loaded machine: compare such runs with care)"
    return line


def load(path: Path) -> tuple[dict, list[Entry]]:
    data = json.loads(path.read_text())
    return data, [Entry(b) for b in data.get("benchmarks", [])]


def build_report(data: dict, entries: list[Entry]) -> tuple[list[str], list[str], int]:
    """Text lines, Markdown lines, and the number of missed targets."""
    text: list[str] = []
    md: list[str] = ["# fastcast benchmarks", ""]
    info = data.get("fastcast", {})
    machine = data.get("machine_info", {})
    versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
    cpu = (machine.get("cpu") or {}).get("brand_raw") or machine.get("processor") or "?"
    about = f"{data.get('datetime', '?')[:19]} | {machine.get('node', '?')} | {cpu}"
    if versions:
        about += f" | {versions}"
    commit = (data.get("commit_info") or {}).get("id")
    if commit:
        about += f" | commit {commit[:10]}" + (
            " (dirty)" if data["commit_info"].get("dirty") else ""
        )
    text.append(about)
    md += [f"_{md_escape(about)}_", "", "Times are per iteration (inner loops divided out).", ""]

    groups: dict[str, list[Entry]] = {}
    for e in entries:
        groups.setdefault(e.group, []).append(e)
    headers = ["benchmark", "median", "IQR", "spread", "vs fastest", "rounds"]
    for group in sorted(groups):
        members = sorted(groups[group], key=lambda e: e.median)
        fastest = members[0].median
        extras = [c for c in EXTRA_COLUMNS if any(c in e.extra for e in members)]
        rows = [
            [
                e.name,
                format_time(e.median),
                format_time(e.iqr),
                format_spread(e),
                format_ratio(e.median / fastest if fastest > 0 else math.nan),
                str(e.rounds),
                *(EXTRA_COLUMNS[c][1](e.extra.get(c)) for c in extras),
            ]
            for e in members
        ]
        columns = [*headers, *(EXTRA_COLUMNS[c][0] for c in extras)]
        right = set(range(1, len(columns)))
        inners = sorted({e.inner for e in members})
        note = (
            f"inner loop {inners[0]}"
            if len(inners) == 1
            else f"inner loops differ: {inners}; ratios are still per iteration"
        )
        text += ["", f"[{group}]  ({note})", *text_table(columns, rows, right)]
        md += [f"## {md_escape(group)}", "", f"_{md_escape(note)}_", ""]
        md += [*md_table(columns, rows, right), ""]

    noise = noise_summary(entries)
    text += ["", noise]
    md += [md_escape(noise), ""]

    by_key = {(e.module, e.group, e.name): e for e in entries}
    rows, missed, skipped, not_run = [], 0, 0, 0
    for t in info.get("targets", []):
        absolute = t["reference"] is None  # a limit on the subject's metric itself
        subject = by_key.get((t["module"], t["group"], t["subject"]))
        reference = None if absolute else by_key.get((t["module"], t["group"], t["reference"]))
        if subject is None and (absolute or reference is None):
            skipped += 1  # nothing ran (filtered out with -k, say)
            continue
        limit = f"<= {t['max_ratio']:g}" if absolute else f"<= {t['max_ratio']:.2f}x"
        if subject is None or (reference is None and not absolute):
            missing = t["subject"] if subject is None else t["reference"]
            rows.append([t["label"], "n/a", limit, f"NOT RUN ({missing})"])
            not_run += 1
            continue
        metric = t.get("metric", "median")
        value = subject.metric(metric)
        if absolute:
            measured = f"{value:g}"
        else:
            ref_value = reference.metric(metric)
            value = value / ref_value if ref_value > 0 else math.inf
            measured = format_ratio(value)
        ok = value <= t["max_ratio"]
        missed += not ok
        label = t["label"] if metric == "median" else f"{t['label']} [{metric}]"
        rows.append([label, measured, limit, "PASS" if ok else "MISS"])
    if rows:
        headers = ["target", "measured", "limit", "result"]
        measured = len(rows) - not_run
        summary = f"{measured - missed} of {measured} measured targets met"
        if not_run + skipped:
            summary += f" ({not_run + skipped} not measured)"
        if missed:
            summary += f"; {missed} MISSED"
        text += [
            "",
            "[targets]  (ratio subject / reference of the median, or of the metric named;"
            " a limit without x applies to the metric itself)",
        ]
        text += [*text_table(headers, rows, {1, 2}), summary]
        md_rows = [[*r[:3], f"**{r[3]}**" if r[3] == "MISS" else md_escape(r[3])] for r in rows]
        md += ["## Targets", "", *md_table(headers, md_rows, {1, 2}, raw=frozenset({3}))]
        md += ["", summary, ""]
    return text, md, missed


def stats_only(data: dict) -> dict:
    """A result without the raw per-round timings (small enough to keep), in place."""
    for bench in data.get("benchmarks", []):
        bench.pop("data", None)
        bench.get("stats", {}).pop("data", None)
    return data
