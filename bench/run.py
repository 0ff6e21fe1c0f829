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
import os
import subprocess
import sys
from pathlib import Path

from bench import history, readme
from bench.report import (
    BENCH_DIR,
    CHARTS,
    COMPILE_TARGET,
    HIGH_PRECISION,
    LATEST,
    OVERHEAD,
    RESULTS,
    ROOT,
    SAMPLE,
    SUMMARY,
    TRAIN_COMPILE,
    TRAIN_STEP,
    build_report,
    load,
    md_escape,
    stats_only,
)

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


def report(path: Path, extras: dict[str, Path] | None = None) -> int:
    """Print ``path``'s tables and write them to summary.md with, after the benchmark
    groups, the overhead report and the training steps (eager, compiled): from
    ``extras`` (their JSON files, this run's) or from the result itself (a sample)."""
    data, entries = load(path)
    if not entries:
        print(f"no benchmark results in {path}")
        return 0
    text, md, _ = build_report(data, entries)
    print("\n".join(text))
    found = dict(data.get("fastcast") or {})
    for key, extra in (extras or {}).items():
        if extra.exists():
            found[key] = json.loads(extra.read_text())
    sections = summary_sections(found)
    SUMMARY.write_text("\n".join([*md, *sections]) + "\n")
    titles = [line[3:] for line in sections if line.startswith("## ")]
    shown = f" (with {', '.join(titles)})" if titles else ""
    print(f"\nMarkdown summary: {SUMMARY.relative_to(ROOT)}{shown}")
    return 0


def summary_sections(found: dict) -> list[str]:
    """summary.md's sections after the benchmark groups: README's overhead, training-step
    and compile tables (bench/readme.py renders both), with the compile target stated."""
    lines: list[str] = []
    if found.get("overhead"):
        lines += ["## Overhead per range (bench.overhead_report)", ""]
        lines += [*readme.overhead_table(found["overhead"]), ""]
    if found.get("train_step"):
        lines += ["## Training step, eager (bench.train_step)", ""]
        lines += [*readme.train_step_table(found["train_step"]), ""]
    compiled = found.get("train_step_compile")
    if compiled:
        lines += ["## Training step, compiled (bench.train_step --compile)", ""]
        lines += [*readme.train_compile_table(compiled), ""]
        verdicts = [
            f"{md_escape(name)} {r['compiled_ms'] / r['eager_ms']:.2f}x "
            + ("pass" if r["compiled_ms"] / r["eager_ms"] <= COMPILE_TARGET else "**miss**")
            for name, r in compiled.get("results", {}).items()
            if name not in HIGH_PRECISION
        ]
        if verdicts:
            lines += [
                f"Target: a compiled FP8/FP4 step <= {COMPILE_TARGET}x its eager step: "
                + ", ".join(verdicts)
                + ".",
                "",
            ]
    return lines


# --------------------------------------------------------------------------- main


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
    if LATEST.exists() and full:  # the summary again, with this run's step results
        print()
        report(LATEST, {"overhead": OVERHEAD, "train_step": TRAIN_STEP,
                        "train_step_compile": TRAIN_COMPILE})  # fmt: skip
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
