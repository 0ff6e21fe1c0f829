"""``make gpu-check``: everything fastcast must prove on a GPU, in one prepared run.

Runs, in this order, each part with its own share of the time budget, so that a part
that fails or runs long still leaves the others their results:

1. ``env``: device, capability, driver, torch, CUDA, Triton and nvcc versions;
   ``build``: the fused kernels built against this machine's torch (timed);
2. ``pytest -m gpu`` (the tests that need a device), counted;
3. ``parity``: every quantizer's codes and scales on CUDA against the CPU path, bit for
   bit (all BF16 values, random FP32 with outliers, non-finite values, unaligned
   shapes, FP32/BF16/FP16 inputs); ``gemm``: every GEMM path against the emulation and
   a float64 reference, the block-scaled GEMMs torch has on this GPU probed with
   fastcast's operands, and the grouped (MoE) GEMM;
4. ``bandwidth``: quantize GB/s at three sizes against a device-to-device copy;
   ``host_time``: an ``fc.Linear`` forward+backward's host time at 64x64 against
   ``nn.Linear``'s (no sync in the loop); ``profile``: kernels, ranges, copies and syncs
   per call from ``torch.profiler``;
5. ``cuda_graph``: a training step captured in a CUDA graph and replayed, per recipe;
6. ``llama``: a Llama-style block (hidden 4096, sequence 2048) forward+backward per
   recipe against BF16 (and torchao's float8 training when it is installed);
7. the whole test suite on this machine (``pytest -n``), with what time is left.

Results go to ``$GPU_CHECK_OUT`` (default ``bench/results/gpu-check``): ``sections.jsonl``
(one line per part, written as each ends), ``gpu_check.json`` and ``gpu_check.md``
(the summary), and the logs. ``GPU_CHECK_BUDGET`` is the time budget in seconds (default
450); ``GPU_CHECK_AUTO_ONLY=1`` times the default kernels only (no Inductor comparison),
``GPU_CHECK_PYTEST`` narrows the ``pytest -m gpu`` part. On a machine without a GPU it
prints what it would run and exits 0; ``--smoke`` runs every part on the CPU at small
sizes instead (a check of this script itself).

    make gpu-check                       # or: python -m bench.gpu_check [--smoke]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The parts, grouped by the child process that runs them (a CUDA error that poisons the
# context then costs only its group), with the share of the budget each group may take.
# (On a fresh machine every part pays Inductor's first compiles of the operators that
# have no CUDA kernel; the earlier parts leave them in its on-disk cache for the later.)
GROUPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("env", "build"), 0.14),
    (("pytest_gpu",), 0.18),
    (("parity", "gemm"), 0.18),
    (("host_time", "profile", "bandwidth"), 0.16),
    (("cuda_graph",), 0.06),
    (("llama",), 0.14),
    (("suite",), 0.14),
)
SUBPROCESS_PARTS = {"pytest_gpu": "tests/cuda tests/kernels -m gpu", "suite": "tests bench/tests"}


def output_dir() -> Path:
    out = Path(os.environ.get("GPU_CHECK_OUT") or ROOT / "bench/results/gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    return out


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def plan(budget: float) -> str:
    lines = [f"gpu-check plan (budget {budget:.0f} s):"]
    for parts, share in GROUPS:
        for part in parts:
            what = SUBPROCESS_PARTS.get(part)
            detail = f"python -m pytest {what}" if what else f"bench.gpu_sections.{part}"
            lines.append(f"  {part:<11} <= {share * budget:5.0f} s (group)  {detail}")
    return "\n".join(lines)


def run_pytest(part: str, out: Path, timeout: float, smoke: bool) -> dict:
    """A pytest run in a child process, its counts read from its log."""
    log = out / f"{part}.log"
    # GPU_CHECK_PYTEST narrows `pytest -m gpu` to chosen files (a short rerun).
    what = os.environ.get("GPU_CHECK_PYTEST") if part == "pytest_gpu" else None
    what = what or SUBPROCESS_PARTS[part]
    args = [sys.executable, "-m", "pytest", *what.split(), "-q", "-rfE"]
    args += ["--tb=short"]
    args += ["-p", "no:cacheprovider", "-o", "addopts="]
    if part == "suite" and importlib.util.find_spec("xdist") is not None:
        workers = 2 if smoke else min(12, os.cpu_count() or 2)
        args += ["-n", str(workers), "--dist", "loadfile"]
        if smoke:
            args += ["-k", "test_recipe", "--maxfail", "5"]
    start = time.perf_counter()
    with open(log, "w") as handle:
        try:
            done = subprocess.run(
                args, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout
            )
            status: int | str = done.returncode
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
    text = log.read_text(errors="replace")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", text)}
    if not counts:  # stopped before its summary: count the progress characters
        progress = "".join(re.findall(r"^([.FsExX]+)(?:\s+\[\s*\d+%\])?$", text, flags=re.M))
        names = {".": "passed", "F": "failed", "s": "skipped", "E": "errors", "x": "xfailed"}
        for char, name in names.items():
            if progress.count(char):
                counts[name] = progress.count(char)
        counts["incomplete"] = 1
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    return {
        "command": " ".join(args[1:]),
        "status": status,
        "seconds": round(time.perf_counter() - start, 1),
        "counts": counts,
        "failed": failed[:60],
    }


def run_group(parts: tuple[str, ...], out: Path, timeout: float, smoke: bool) -> None:
    """The in-process parts of one group, in a child process that writes each part's line
    to sections.jsonl as it ends."""
    args = [sys.executable, "-m", "bench.gpu_sections", ",".join(parts), str(out)]
    if smoke:
        args.append("--smoke")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    try:
        done = subprocess.run(args, cwd=ROOT, env=env, timeout=timeout)
        status: int | str = done.returncode
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:.0f} s"
    if status != 0:
        record(out, {"part": "+".join(parts), "group_status": status})


def record(out: Path, line: dict) -> None:
    with open(out / "sections.jsonl", "a") as handle:
        handle.write(json.dumps(line, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fastcast's GPU check (make gpu-check)")
    parser.add_argument("--smoke", action="store_true", help="run every part on the CPU, small")
    parser.add_argument("--only", default="", help="comma-separated parts to run (default all)")
    args = parser.parse_args(argv)
    budget = float(os.environ.get("GPU_CHECK_BUDGET", "450"))
    print(plan(budget), flush=True)
    if not args.smoke and not has_gpu():
        print("no CUDA device here: nothing run (--smoke runs the parts on the CPU)")
        return 0
    out = output_dir()
    (out / "sections.jsonl").unlink(missing_ok=True)
    only = set(filter(None, args.only.split(",")))
    groups = [(tuple(p for p in parts if not only or p in only), share) for parts, share in GROUPS]
    groups = [(parts, share) for parts, share in groups if parts]
    total_share = sum(share for _, share in groups)
    deadline = time.monotonic() + budget
    for parts, share in groups:
        share /= total_share  # the budget shared among the parts that run
        left = deadline - time.monotonic()
        # The last group (the suite) takes whatever is left; the others their share,
        # or less when earlier groups overran.
        allowed = left if parts == ("suite",) else min(share * budget * 1.5, left)
        if allowed < 10:
            record(out, {"part": "+".join(parts), "skipped": "no time left in the budget"})
            continue
        print(f"== {'+'.join(parts)} (up to {allowed:.0f} s)", flush=True)
        if parts[0] in SUBPROCESS_PARTS:
            result = run_pytest(parts[0], out, allowed - 5, args.smoke)
            record(out, {"part": parts[0], "result": result})
            print(json.dumps(result)[:600], flush=True)
        else:
            run_group(parts, out, allowed, args.smoke)
    from bench.gpu_summary import summarise  # noqa: PLC0415 - after the runs

    summarise(out)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
