"""Spawning gloo ranks for the distributed tests: what every distributed test file uses."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Every distributed test file's marks: ``pytest -m distributed`` selects them, and they
# skip where torch has no gloo backend.
DISTRIBUTED_MARKS = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not available",
    ),
]


def spawn_ranks(
    entry: Callable[..., None],
    section: str,
    world: int,
    out_dir: Path,
    timeout: float,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``entry(section, rank, world, init_file, out_dir)`` on ``world`` spawned ranks
    (``env`` added to their environment) and return their results, by rank. Ranks still
    running after ``timeout`` seconds are killed; a failure shows every rank's traceback.

    The fused kernels are built (or found) here, once, rather than in each cold worker; a
    machine that cannot build them runs the reference in the workers."""
    from fastcast.kernels import build  # noqa: PLC0415

    try:
        build.load()
    except build.BuildError:
        pass
    ctx = mp.get_context("spawn")
    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the spawned processes
    try:
        procs = [
            ctx.Process(
                target=entry,
                args=(section, rank, world, str(out_dir / "pg_init"), str(out_dir)),
                daemon=True,
            )
            for rank in range(world)
        ]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = "".join(
        f"\n--- rank {rank} ---\n{(out_dir / f'error_rank{rank}.txt').read_text()}"
        for rank in range(world)
        if (out_dir / f"error_rank{rank}.txt").exists()
    )
    if hung:
        pytest.fail(f"{section}: ranks {hung} still running after {timeout}s{errors}")
    codes = [p.exitcode for p in procs]
    if any(codes):
        pytest.fail(f"{section}: worker exit codes {codes}{errors}")
    return [
        torch.load(out_dir / f"{section}_rank{rank}.pt", weights_only=True) for rank in range(world)
    ]


def share(results: list[dict[str, Any]], suffix: str = ".reference") -> list[dict[str, Any]]:
    """Each rank's results with every rank's entries whose key ends with ``suffix`` (the
    single-process runs the ranks shared out among themselves)."""
    shared = {k: v for r in results for k, v in r.items() if k.endswith(suffix)}
    return [{**r, **shared} for r in results]
