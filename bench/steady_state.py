"""The training step in its steady state, for a sampling profiler: ``make profile``.

``python -m bench.steady_state --recipe current --steps 100 --ready FILE --go FILE``
builds bench/train_step.py's model for ``recipe`` and runs ``--warmup`` steps (imports,
the kernel library's load, plans, allocator caches: what a profile of training should
not show), then creates ``--ready`` and waits (at most ``--wait`` seconds) for ``--go``
to exist before it runs ``--steps`` more steps and exits. profiles/record.sh attaches
py-spy to the process between the two files, so the samples are the steady state only.

On Linux the process allows any process of the same user to attach to it
(``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``): with Yama's ``ptrace_scope`` 1, the
common default, only a process's ancestors may trace it otherwise, and py-spy is its
sibling here.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.overhead_report import training_step
from bench.train_step import DEFAULTS, QUANTIZED

PR_SET_PTRACER = 0x59616D61  # "Yama"
PR_SET_PTRACER_ANY = -1


def allow_attach() -> None:
    """Let a sibling profiler attach under Yama's ``ptrace_scope`` 1 (Linux only; a
    no-op elsewhere and where prctl refuses)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY & (2**64 - 1)), 0, 0, 0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.steady_state", description=__doc__)
    p.add_argument("--recipe", default="current", choices=sorted(QUANTIZED))
    p.add_argument("--steps", type=int, default=100, help="steady-state steps (profiled)")
    p.add_argument("--warmup", type=int, default=10, help="steps before --ready")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--ready", type=Path, required=True, help="created after the warm-up")
    p.add_argument("--go", type=Path, required=True, help="waited for before the steps")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for --go")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1")
    allow_attach()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)  # as bench.train_step runs on a shared CPU
    total = args.warmup + args.steps
    step = training_step(
        args.recipe, DEFAULTS["width"], DEFAULTS["depth"], DEFAULTS["batch"], total, device
    )
    for i in range(args.warmup):
        step(i)
    args.ready.touch()
    deadline = time.monotonic() + args.wait
    while not args.go.exists():
        if time.monotonic() > deadline:
            print(f"steady_state: {args.go} did not appear in {args.wait:g} s", file=sys.stderr)
            return 1
        time.sleep(0.05)
    start = time.perf_counter()
    for i in range(args.warmup, total):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(
        f"steady_state: {args.recipe}, {args.steps} steps after {args.warmup} warm-up steps, "
        f"{seconds / args.steps * 1e3:.2f} ms per step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
