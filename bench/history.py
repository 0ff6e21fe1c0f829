"""Benchmark history per machine, and run-to-run comparison: ``make bench-compare``.

Every ``make bench`` run is saved (stats only, as in the sample) to
``bench/results/history/<machine>/<UTC time>_<commit>.json``, a folder git ignores.
``python -m bench.history [--threshold 1.10] [OLD.json NEW.json]`` compares the newest
saved run with the one before (or two files, sample.json included): per benchmark, the
per-call medians (inner loops divided out, as bench/run.py's tables) and their ratio
new / old, marked REGRESSION above the threshold and faster below its inverse. Only
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

from bench.report import RESULTS, Entry, format_ratio, format_time, stats_only, text_table

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


def compare(old: dict, new: dict, threshold: float = THRESHOLD) -> list[dict]:
    """Per benchmark present in both: per-call medians, ratio new/old and a status."""
    if threshold <= 1:
        raise ValueError(f"bench.history: threshold must be > 1, got {threshold}")
    before = {b["fullname"]: Entry(b) for b in old.get("benchmarks", [])}
    rows = []
    for raw in new.get("benchmarks", []):
        a = before.get(raw["fullname"])
        if a is None:
            continue
        b = Entry(raw)
        ratio = b.median / a.median if a.median > 0 else math.inf
        status = "REGRESSION" if ratio > threshold else "faster" if ratio < 1 / threshold else ""
        rows.append(
            {"group": b.group, "name": b.name, "old": a.median, "new": b.median, "ratio": ratio}
            | {"status": status}
        )
    return sorted(rows, key=lambda r: (r["group"], r["name"]))


def format_comparison(rows: list[dict], old_label: str, new_label: str, threshold: float) -> str:
    table = [
        [r["group"], r["name"], format_time(r["old"]), format_time(r["new"])]
        + [format_ratio(r["ratio"]), r["status"]]
        for r in rows
    ]
    headers = ["group", "benchmark", "old (per call)", "new (per call)", "new/old", ""]
    regressed = sum(r["status"] == "REGRESSION" for r in rows)
    lines = [f"old: {old_label}", f"new: {new_label}", ""]
    lines += text_table(headers, table, {2, 3, 4})
    lines += [
        "",
        f"{len(rows)} benchmarks compared, {regressed} slower than {threshold:.2f}x "
        f"(REGRESSION), {sum(r['status'] == 'faster' for r in rows)} faster than "
        f"{1 / threshold:.2f}x",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__)
    p.add_argument("files", nargs="*", type=Path, help="OLD.json NEW.json (default: history)")
    p.add_argument("--threshold", type=float, default=THRESHOLD)
    p.add_argument("--strict", action="store_true", help="exit 1 when anything regressed")
    p.add_argument("--machine", default=None, help="history folder (default: this machine's)")
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
    rows = compare(
        json.loads(old_path.read_text()), json.loads(new_path.read_text()), args.threshold
    )
    print(format_comparison(rows, str(old_path), str(new_path), args.threshold))
    regressed = any(r["status"] == "REGRESSION" for r in rows)
    return 1 if args.strict and regressed else 0


def _this_machine() -> str:
    import platform  # noqa: PLC0415 - pytest-benchmark records platform.node() too

    return machine_key({"machine_info": {"node": platform.node()}})


if __name__ == "__main__":
    sys.exit(main())
