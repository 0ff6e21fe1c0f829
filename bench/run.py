"""Run the benchmark suites and summarise them: ``python -m bench.run [PYTEST ARGS]``.

This is what ``make bench`` runs, from the repository root. It

1. runs pytest on ``bench/`` in one process (so that every ratio compares timings taken
   in the same process, on the same warm interpreter) with ``--benchmark-only``, a
   warm-up, the garbage collector off while timing, and the JSON report written to
   ``bench/results/latest.json``; extra arguments are passed on to pytest
   (``python -m bench.run -k autocast``; a path argument replaces ``bench/``);
2. prints a table per benchmark group (median and IQR per iteration, ratio to the
   group's fastest entry) and a table of targets (measured ratio, limit, PASS/MISS),
   and writes the same tables in Markdown to ``bench/results/summary.md``;
3. saves the run (stats only) in ``bench/results/history/<machine>/`` for
   ``make bench-compare`` (bench/history.py: per-call ratios against the previous run);
4. on a full run (no extra arguments): runs ``python -m bench.overhead_report``
   (per-range CPU vs kernel time of the training step, JSON and a Chrome trace in
   ``profiles/out/``), ``python -m bench.train_step`` and ``python -m bench.train_step
   --compile`` (compiled vs eager steps, compile times, torchao as the peer) in
   subprocesses, printing their output (a filtered run, ``-k autocast``, skips this);
5. draws the charts (bench/charts.py, matplotlib from the ``[bench]`` extra) into
   ``bench/results/charts/``;
6. with ``--update-sample`` (``make bench-sample``), after a successful full run, copies
   ``latest.json`` to ``bench/results/sample.json``, less the raw per-round timings, with
   the same run's overhead report and training-step results (``bench.train_step
   --json``, eager and compiled) added (the one result file under version control;
   ``make readme`` renders README's tables and charts from it). A plain ``make bench``
   changes no tracked file.

The exit status is pytest's (or train_step's when pytest passed): a missed target is
printed as MISS but does not fail the run. ``python -m bench.run --report FILE`` renders
the tables of a saved JSON without running anything.

Conventions for benchmark modules
---------------------------------
- Files are ``bench/bench_*.py``; tests are ``test_*`` functions that use
  pytest-benchmark's ``benchmark`` fixture and set ``benchmark.group``.
- Operations that take well under a microsecond are timed with an inner loop inside the
  benchmarked function (``for _ in range(INNER): ...``), so that the timer's own cost
  does not dominate. Record the count as ``benchmark.extra_info["inner"] = INNER``; the
  tables divide by it and so report per iteration. Give every entry of a group the same
  inner count and loop shape, so that the loop overhead is the same for all of them.
- A module may define ``TARGETS = [(group, subject, reference, max_ratio, label), ...]``:
  ``subject`` and ``reference`` are test names as pytest-benchmark reports them
  (``test_name``, or ``test_name[param]`` when parametrized), both in ``group``; the
  target passes when ``median(subject) / median(reference) <= max_ratio``. A sixth
  element names an ``extra_info`` key to compare instead of the median (``"bytes"``);
  with it, ``reference`` may be None: the subject's value itself must be <= the limit
  (``"aten_ops"``, a count of ATen operations).
- A benchmark that writes a file records its size as ``benchmark.extra_info["bytes"]``;
  its group's table then shows it in a ``bytes`` column. Likewise ``"aten_ops"`` (ATen
  operations dispatched per iteration) gets an ``ATen ops`` column.
- Per-test timing options can be changed with ``@pytest.mark.benchmark(min_rounds=...,
  max_time=...)``; slow benchmarks should lower ``min_rounds`` there, not here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
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

PYTEST_OPTIONS = [
    "-o",
    "python_files=bench_*.py",
    "--benchmark-only",
    f"--benchmark-json={LATEST}",
    "--benchmark-min-rounds=20",
    "--benchmark-max-time=0.5",
    "--benchmark-warmup=on",
    "--benchmark-warmup-iterations=200",
    "--benchmark-disable-gc",
    "--benchmark-quiet",  # our tables replace pytest-benchmark's (which are per call)
]


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


def _text_table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
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


def _md_table(
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
    headers = ["benchmark", "median", "IQR", "vs fastest", "rounds"]
    for group in sorted(groups):
        members = sorted(groups[group], key=lambda e: e.median)
        fastest = members[0].median
        extras = [c for c in EXTRA_COLUMNS if any(c in e.extra for e in members)]
        rows = [
            [
                e.name,
                format_time(e.median),
                format_time(e.iqr),
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
        text += ["", f"[{group}]  ({note})", *_text_table(columns, rows, right)]
        md += [f"## {md_escape(group)}", "", f"_{md_escape(note)}_", ""]
        md += [*_md_table(columns, rows, right), ""]

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
        text += [*_text_table(headers, rows, {1, 2}), summary]
        md_rows = [[*r[:3], f"**{r[3]}**" if r[3] == "MISS" else md_escape(r[3])] for r in rows]
        md += ["## Targets", "", *_md_table(headers, md_rows, {1, 2}, raw=frozenset({3}))]
        md += ["", summary, ""]
    return text, md, missed


def report(path: Path) -> int:
    data, entries = load(path)
    if not entries:
        print(f"no benchmark results in {path}")
        return 0
    text, md, _ = build_report(data, entries)
    print("\n".join(text))
    SUMMARY.write_text("\n".join(md) + "\n")
    print(f"\nMarkdown summary: {SUMMARY.relative_to(ROOT)}")
    return 0


# --------------------------------------------------------------------------- main


def stats_only(data: dict) -> dict:
    """A result without the raw per-round timings (small enough to keep), in place."""
    for bench in data.get("benchmarks", []):
        bench.pop("data", None)
        bench.get("stats", {}).pop("data", None)
    return data


def write_sample(
    source: Path,
    dest: Path,
    overhead: Path | None = None,
    train_step: Path | None = None,
    train_compile: Path | None = None,
) -> None:
    """Copy a result JSON, stats only, to ``dest``; the overhead report's JSON and the
    training-step results (eager, compiled) of the same run go in too, where given
    (``fastcast.overhead``, ``fastcast.train_step``, ``fastcast.train_step_compile``:
    README's tables and chart)."""
    data = stats_only(json.loads(source.read_text()))
    extra = {"overhead": overhead, "train_step": train_step, "train_step_compile": train_compile}
    for key, path in extra.items():
        if path is not None and path.exists():
            data.setdefault("fastcast", {})[key] = json.loads(path.read_text())
    dest.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _has_path_argument(args: list[str]) -> bool:
    return any(not a.startswith("-") and Path(a.split("::")[0]).exists() for a in args)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    update_sample = "--update-sample" in args
    args = [a for a in args if a != "--update-sample"]
    if args[:1] == ["--report"]:
        if len(args) != 2:
            print("usage: python -m bench.run --report FILE.json", file=sys.stderr)
            return 2
        return report(Path(args[1]))

    os.chdir(ROOT)
    RESULTS.mkdir(parents=True, exist_ok=True)
    LATEST.unlink(missing_ok=True)
    paths = [] if _has_path_argument(args) else [str(BENCH_DIR.relative_to(ROOT))]
    cmd = [sys.executable, "-m", "pytest", *paths, *PYTEST_OPTIONS, *args]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)

    if LATEST.exists():
        print()
        report(LATEST)
        from bench import history  # noqa: PLC0415 - it imports this module

        saved = history.save(LATEST)
        print(f"Saved for `make bench-compare`: {saved.relative_to(ROOT)}")
    else:
        print(f"pytest wrote no {LATEST.relative_to(ROOT)} (exit status {rc})")
    if rc != 0:
        print(f"\npytest failed with exit status {rc}", file=sys.stderr)

    full = not args  # a filtered run (-k ...) runs the benchmarks only
    for stale in (TRAIN_STEP, TRAIN_COMPILE) if full else ():  # this run's reach the sample
        stale.unlink(missing_ok=True)
    steps = [
        ["bench.overhead_report"],
        ["bench.train_step", "--json", str(TRAIN_STEP)],
        ["bench.train_step", "--compile", "--json", str(TRAIN_COMPILE)],
    ]
    for step in steps if full else []:
        shown = " ".join(["python -m", *step])
        print(f"\n$ {shown}", flush=True)
        step_rc = subprocess.call([sys.executable, "-m", *step])
        if step_rc != 0:
            print(f"{shown} failed with exit status {step_rc}", file=sys.stderr)
            rc = rc or step_rc
    if LATEST.exists():
        _charts(["--results", str(LATEST), "--overhead", str(OVERHEAD), "--out", str(CHARTS)])
    if update_sample and rc == 0 and full:
        write_sample(LATEST, SAMPLE, OVERHEAD, TRAIN_STEP, TRAIN_COMPILE)
        print(f"Sample results: {SAMPLE.relative_to(ROOT)}")
    return rc


def _charts(args: list[str]) -> None:
    """The PNG charts, in a subprocess (matplotlib is optional: a missing one is said)."""
    print(f"\n$ python -m bench.charts {' '.join(args)}", flush=True)
    if subprocess.call([sys.executable, "-m", "bench.charts", *args]) != 0:
        print("charts not drawn (see above)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
