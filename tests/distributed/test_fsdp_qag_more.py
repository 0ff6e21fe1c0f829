"""FSDP2's quantized all-gather (``fc.convert(..., quantized_all_gather=True)``), every
recipe, beyond ``test_distributed.py``'s two-rank training: gradient accumulation with
``is_first_microbatch``, 4 ranks, uneven shards, ``torch.compile`` and DCP (gloo, CPU;
workers in ``_qag_workers.py``, one spawn per module-scoped fixture)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _qag_workers as workers
import pytest
import torch
import torch.distributed as dist
from _spawn import spawn_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not available",
    ),
]

HARD_TIMEOUT = 240.0  # seconds for a whole spawn; a healthy one takes well under a minute


def spawn(section: str, world: int, out_dir: Path) -> list[dict[str, Any]]:
    from fastcast.kernels import build  # noqa: PLC0415

    build.load()  # the fused kernels built once here, not in each cold worker
    return spawn_ranks(workers.entry, section, world, out_dir, HARD_TIMEOUT)


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


def assert_same_run(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert torch.equal(a["losses"], b["losses"]), what
    for name, p in b["params"].items():
        assert torch.equal(a["params"][name], p), (what, name)


# -- 1. gradient accumulation: is_first_microbatch with the quantized gather -----------------


@pytest.fixture(scope="module")
def qag_two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn("qag_two", 2, tmp_path_factory.mktemp("qag_two"))


@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_accumulation_keeps_the_gathered_quantized_weight(qag_two, recipe):
    """``reshard_after_forward=False`` and the weights kept gathered until the last
    micro-batch's backward (``set_reshard_after_backward``), gradient sync on the last
    micro-batch only: one quantized gather per weight and step, every forward GEMM of
    every micro-batch takes that gathered weight, and the run equals the high-precision
    gather's (``is_first_microbatch`` keeping the quantized weight there) bit for bit,
    and one process on the same micro-batches within FP32 rounding."""
    layers, ref = 2, qag_two[0][f"{recipe}.reference"]
    losses = 0
    for rank, result in enumerate(qag_two):
        run = result[f"{recipe}.keep"]
        assert run["gathers"] == [layers] * workers.STEPS, rank
        assert run["direct"] == [layers * workers.MICRO] * workers.STEPS, rank
        assert result[f"{recipe}.keep_hp"]["gathers"] == [0] * workers.STEPS
        assert_same_run(run, result[f"{recipe}.keep_hp"], f"rank {rank}")
        assert max_rel(run["params"], ref["params"]) < 1e-5, rank
        losses = losses + run["losses"]
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-6, atol=0)
    assert losses[-1].sum() < losses[0].sum()


@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_accumulation_regathers_each_micro_batch(qag_two, recipe):
    """FSDP2's default ``reshard_after_forward=True``: each micro-batch gathers its
    weights quantized in forward and again in backward, the flag notwithstanding, and
    the run equals the high-precision gather's bit for bit. An unchanged weight gives the
    same codes at every gather, so (but for DelayedScaling, whose scale moves after each
    micro-batch while a kept weight keeps the first one's) it also equals the run that
    keeps the weights gathered."""
    layers = 2
    for rank, result in enumerate(qag_two):
        run = result[f"{recipe}.regather"]
        assert run["gathers"] == [2 * layers * workers.MICRO] * workers.STEPS, rank
        assert run["direct"] == [layers * workers.MICRO] * workers.STEPS, rank
        assert_same_run(run, result[f"{recipe}.regather_hp"], f"rank {rank}")
        if recipe != "delayed":
            assert_same_run(run, result[f"{recipe}.keep"], f"rank {rank}")


@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_accumulation_forward_after_the_backward_regather(qag_two, recipe):
    """``reshard_after_forward=True`` with the weights kept gathered after the backward
    of all but the last micro-batch: the next forward takes the weight backward's
    re-gather left (row-wise and MXFP8 carry the column-wise layout there, and that
    forward gathers the row-wise one itself), with the same codes: the run equals the
    one that keeps the forward's gather, bit for bit."""
    layers = 2
    for rank, result in enumerate(qag_two):
        run = result[f"{recipe}.after_backward"]
        # The first micro-batch gathers in forward and backward, the second in backward.
        assert run["gathers"] == [layers * (2 * workers.MICRO - 1)] * workers.STEPS, rank
        assert run["direct"] == [layers * workers.MICRO] * workers.STEPS, rank
        assert_same_run(run, result[f"{recipe}.keep"], f"rank {rank}")
