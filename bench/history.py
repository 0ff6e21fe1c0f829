"""Benchmark history per machine, and run-to-run comparison: ``make bench-compare``.

Every ``make bench`` run is saved (stats only, as in the sample) to
``bench/results/history/<machine>/<UTC time>_<commit>.json``, a folder git ignores.
``python -m bench.history [--threshold 1.10] [OLD.json NEW.json]`` compares the newest
saved run with the one before (or two files, sample.json included): per benchmark, the
per-call medians (inner loops divided out, as bench/run.py's tables) and their ratio
new / old. Only runs of one machine (host name and CPU) are compared: two machines'
timings say nothing about a regression (``--any-machine`` prints their bare ratios).

A loaded machine slows everything: the baselines (``BASELINES``, benchmarks of PyTorch
or Python alone, measured in the same run) show by how much, so each group's ratios are
divided by its baselines' ratio (the drift, printed for the run) before a verdict. A
benchmark is then a REGRESSION above the threshold, and faster below its inverse, only
when that change exceeds its own spread (IQR / median of its rounds, in either run,
printed beside it); beyond the threshold but within the spread it is marked noisy. Only
benchmarks present in both runs are compared (a run filtered with ``-k`` compares what
it ran). ``--strict`` exits 1 when anything regressed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from bench.report import (
    RESULTS,
    Entry,
    format_ratio,
    format_time,
    spread,
    stats_only,
    text_table,
)

HISTORY = RESULTS / "history"
THRESHOLD = 1.10


def machine_key(data: dict) -> str:
    """A folder name for the machine a result came from (its host name)."""
    node = (data.get("machine_info") or {}).get("node") or "unknown"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", node)


def save(latest: Path, store: Path = HISTORY) -> Path:
    """Store ``latest`` (stats only) in this machine's history; return its path."""
    data = stats_only(json.loads(latest.read_text()))
    stamp = data.get("datetime") or datetime.now(timezone.utc).isoformat()
    stamp = re.sub(r"[^0-9T]", "", stamp.split(".")[0])  # 2026-11-23T21:52:47 -> 20261123T215247
    commit = ((data.get("commit_info") or {}).get("id") or "nocommit")[:10]
    folder = store / machine_key(data)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stamp}_{commit}.json"
    n = 1
    while path.exists():  # two runs in one second: keep both
        n += 1
        path = folder / f"{stamp}_{commit}_{n}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def runs(machine: str, store: Path = HISTORY) -> list[Path]:
    """This machine's saved runs, oldest first."""
    folder = store / machine
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


# Benchmarks that time PyTorch or Python alone, never fastcast: what they drift between
# two runs is the machine's doing (load, frequency), so each group's ratios are divided
# by its baselines' ratio before anything is called a regression.
BASELINES = frozenset(
    {
        "test_empty_slots_cm",
        "test_slots_cm_storing_args",
        "test_contextmanager_generator",
        "test_torch_autocast_cpu",
        "test_nn_linear",
        "test_plain_cast",
        "test_save_torch[nn]",
        "test_load_torch[nn]",
        "test_save_safetensors[nn]",
        "test_load_safetensors[nn]",
    }
)


def machine_of(data: dict) -> str:
    """The machine a result ran on: host name and CPU (what makes timings comparable)."""
    info = data.get("machine_info") or {}
    cpu = (info.get("cpu") or {}).get("brand_raw") or info.get("processor") or "?"
    return f"{info.get('node') or 'unknown'} ({cpu})"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def compare(old: dict, new: dict, threshold: float = THRESHOLD) -> list[dict]:
    """Per benchmark present in both: per-call medians, their ratio new/old, the ratio
    of its group's baselines (``drift``: the machine's own slowdown between the runs),
    the ratio divided by it (``adjusted``), both runs' spread (IQR / median) and a
    status: REGRESSION when ``adjusted`` exceeds ``threshold`` by more than the noisier
    run's spread, ``faster`` likewise below its inverse, ``noisy`` when it exceeds the
    threshold but not the spread."""
    if threshold <= 1:
        raise ValueError(f"bench.history: threshold must be > 1, got {threshold}")
    before = {b["fullname"]: Entry(b) for b in old.get("benchmarks", [])}
    pairs = [(before[r["fullname"]], Entry(r)) for r in new.get("benchmarks", [])
             if r["fullname"] in before]  # fmt: skip

    def ratio(a: Entry, b: Entry) -> float:
        return b.median / a.median if a.median > 0 else math.inf

    baseline = [(b.group, ratio(a, b)) for a, b in pairs if b.name in BASELINES]
    # Without baselines in both runs nothing tells load from a change: no correction.
    overall = _median([r for _, r in baseline] or [1.0])
    rows = []
    for a, b in pairs:
        in_group = [r for g, r in baseline if g == b.group]
        drift = _median(in_group) if in_group else overall
        raw = ratio(a, b)
        adjusted = raw / drift if b.name not in BASELINES else raw / overall
        noise = max(spread(a), spread(b))
        if adjusted > threshold:
            status = "REGRESSION" if adjusted - 1 > noise else "noisy"
        elif adjusted < 1 / threshold:
            status = "faster" if 1 - adjusted > noise else "noisy"
        else:
            status = ""
        rows.append(
            {"group": b.group, "name": b.name, "old": a.median, "new": b.median, "ratio": raw}
            | {"drift": drift, "adjusted": adjusted, "status": status}
            | {"spread_old": spread(a), "spread_new": spread(b), "baseline": b.name in BASELINES}
        )
    return sorted(rows, key=lambda r: (r["group"], r["name"]))


def drift_summary(rows: list[dict]) -> str:
    """One line: how much slower the machine ran the baselines in the new run."""
    base = [r["ratio"] for r in rows if r["baseline"]]
    if not base:
        return "no baseline benchmark in both runs: ratios are not corrected for machine load"
    spreads = [r["spread_new"] for r in rows]
    return (
        f"machine drift (baselines, PyTorch alone; new/old): median {_median(base):.2f}x, "
        f"range {min(base):.2f}x-{max(base):.2f}x over {len(base)}; each group's ratios are "
        f"divided by its baselines'. Spread (IQR/median) of the new run: median "
        f"{_median(spreads):.0%}, worst {max(spreads):.0%}"
    )


def format_comparison(
    rows: list[dict], old_label: str, new_label: str, threshold: float, verdicts: bool = True
) -> str:
    table = [
        [r["group"], r["name"] + (" (baseline)" if r["baseline"] else "")]
        + [format_time(r["old"]), format_time(r["new"]), format_ratio(r["ratio"])]
        + [format_ratio(r["adjusted"]), f"{r['spread_old']:.0%} / {r['spread_new']:.0%}"]
        + [r["status"]]
        for r in rows
    ]
    headers = ["group", "benchmark", "old (per call)", "new (per call)", "new/old"]
    headers += ["/ drift", "spread old/new", ""]
    count = {s: sum(r["status"] == s for r in rows) for s in ("REGRESSION", "faster", "noisy")}
    lines = [f"old: {old_label}", f"new: {new_label}", drift_summary(rows), ""]
    lines += text_table(headers, table, {2, 3, 4, 5, 6})
    if not verdicts:
        return "\n".join([*lines, "", f"{len(rows)} benchmarks compared (two machines: "
                           "ratios only, no verdicts)"])  # fmt: skip
    lines += [
        "",
        f"{len(rows)} benchmarks compared, {count['REGRESSION']} slower than {threshold:.2f}x "
        f"after drift (REGRESSION), {count['faster']} faster than {1 / threshold:.2f}x, "
        f"{count['noisy']} beyond the threshold but within their own spread (noisy)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__)
    p.add_argument("files", nargs="*", type=Path, help="OLD.json NEW.json (default: history)")
    p.add_argument("--threshold", type=float, default=THRESHOLD)
    p.add_argument("--strict", action="store_true", help="exit 1 when anything regressed")
    p.add_argument("--machine", default=None, help="history folder (default: this machine's)")
    p.add_argument(
        "--any-machine",
        action="store_true",
        help="compare runs of two machines (ratios only: no verdicts)",
    )
    args = p.parse_args(argv)
    if args.files and len(args.files) != 2:
        p.error("give two files (OLD NEW) or none")
    if args.files:
        old_path, new_path = args.files
    else:
        machine = args.machine or _this_machine()
        saved = runs(machine)
        if len(saved) < 2:
            print(
                f"bench.history: {len(saved)} saved run(s) in {HISTORY / machine}; "
                "run `make bench` twice (each run is saved) or pass OLD.json NEW.json"
            )
            return 2
        old_path, new_path = saved[-2], saved[-1]
    old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
    if machine_of(old) != machine_of(new):
        if not args.any_machine:
            print(
                f"bench.history: {old_path} ran on {machine_of(old)}, {new_path} on "
                f"{machine_of(new)}: timings of two machines say nothing about a regression. "
                "Compare two runs of this machine (`make bench` twice, then `make "
                "bench-compare`), or pass --any-machine for the bare ratios."
            )
            return 2
    rows = compare(old, new, args.threshold)
    same = machine_of(old) == machine_of(new)
    if not same:
        for row in rows:
            row["status"] = ""  # two machines: ratios, no verdicts
    old_label = f"{old_path} ({machine_of(old)})"
    new_label = f"{new_path} ({machine_of(new)})"
    print(format_comparison(rows, old_label, new_label, args.threshold, verdicts=same))
    regressed = any(r["status"] == "REGRESSION" for r in rows)
    return 1 if args.strict and regressed else 0


def _this_machine() -> str:
    import platform  # noqa: PLC0415 - pytest-benchmark records platform.node() too

    return machine_key({"machine_info": {"node": platform.node()}})


if __name__ == "__main__":
    sys.exit(main())
