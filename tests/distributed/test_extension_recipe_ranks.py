"""The recipe of ``tests/test_extension_recipe.py`` (defined there, through the extension
API alone) on two gloo ranks: tensor parallelism, sequence parallelism with the quantized
input gather, and FSDP2 with the weights gathered quantized, each trained against one
process. One spawn runs all three and the single-process run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _spawn import DISTRIBUTED_MARKS, spawn_ranks
from test_extension_recipe import RECIPE
from torch import nn

import fastcast as fc

pytestmark = DISTRIBUTED_MARKS

WORLD, TOKENS, IN, HIDDEN = 2, 32, 64, 128
NUMEL = 2 * TOKENS * IN  # the whole batch's targets


def _mlp() -> nn.Sequential:
    torch.manual_seed(7)
    return fc.convert(nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, IN)))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(model: nn.Module, feed: Any, group: Any = None, lr: float = 0.1) -> dict[str, Any]:
    """Two SGD steps; ``feed(x)`` is what this rank's model takes of the batch, the loss
    is over what it returns (made whole) against the targets it matches, divided by
    the whole batch's size (each rank's gradient is then its share)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(2):
        gen = torch.Generator().manual_seed(40 + step)
        x, y = torch.randn(2, TOKENS, IN, generator=gen), torch.randn(2, TOKENS, IN, generator=gen)
        inp, target = feed(x, y)
        with fc.autocast(recipe=RECIPE, amax_reduction_group=group):
            out = model(inp)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = (out - target).square().sum() / NUMEL
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "params": params}


class _CountUint8Gathers:
    """Counts the uint8 all-gathers (fastcast's quantized ones) while entered."""

    def __enter__(self) -> _CountUint8Gathers:
        import torch.distributed as dist  # noqa: PLC0415

        self.count = 0
        self.saved = {
            n: getattr(dist, n)
            for n in ("all_gather_into_tensor", "all_gather_single")
            if hasattr(dist, n)
        }
        for name, fn in self.saved.items():
            setattr(dist, name, self._counting(fn))
        return self

    def _counting(self, fn: Any) -> Any:
        def gather(out: torch.Tensor, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.count += t.dtype == torch.uint8
            return fn(out, t, *args, **kwargs)

        return gather

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist  # noqa: PLC0415

        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _section(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from fastcast.distributed.fsdp import GatheredFloat8Weight  # noqa: PLC0415
    from fastcast.distributed.sequence_parallel import QuantizedColwiseParallel  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (world,))
    whole = lambda x, y: (x, y)  # noqa: E731
    res: dict[str, Any] = {"single": _train(_mlp(), whole)}
    # Tensor parallelism: the same batch on every rank.
    tp = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    res["tp"] = _train(tp, whole)
    # Sequence parallelism: each rank holds half of every sequence's tokens; the first
    # layer all-gathers them quantized, the last reduce-scatters its output back.
    n = TOKENS // world
    mine = slice(rank * n, (rank + 1) * n)
    sp_plan = {
        "0": QuantizedColwiseParallel(input_layouts=Shard(1)),
        "2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    sp = parallelize_module(_mlp(), mesh, sp_plan)

    def sequence_slice(x: torch.Tensor, y: torch.Tensor) -> tuple[DTensor, torch.Tensor]:
        return DTensor.from_local(x[:, mine].contiguous(), mesh, [Shard(1)], run_check=False), y

    with _CountUint8Gathers() as gathers:
        res["sp"] = _train(sp, sequence_slice)
    res["sp_uint8_gathers"] = gathers.count
    # FSDP2, the weights gathered quantized: each rank trains on one of the sequences,
    # amaxes reduced over both (FSDP2 averages gradients: twice the learning rate).
    model = fc.convert(_mlp(), recipe=RECIPE, quantized_all_gather=True, keep_head=False)
    res["fsdp_wrapped"] = sum(type(m.weight).__name__ == "FSDPFloat8Weight" for m in model[::2])
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    share = lambda x, y: (x[rank : rank + 1], y[rank : rank + 1])  # noqa: E731
    direct = [0]  # GEMM operands taken from the gathered codes as they are
    as_operand = GatheredFloat8Weight.quantized

    def counted(self: Any, columnwise: bool) -> Any:
        direct[0] += 1
        return as_operand(self, columnwise)

    GatheredFloat8Weight.quantized = counted
    try:
        res["fsdp"] = _train(model, share, dist.group.WORLD, 0.1 * world)
    finally:
        GatheredFloat8Weight.quantized = as_operand
    res["fsdp_direct"] = direct[0]
    return res


def entry(section: str, rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The spawned ranks' target (``tests/_dist_workers.entry`` over ``_section``)."""
    import _dist_workers as base  # noqa: PLC0415 - tests/, on the spawned process's path

    base.SECTIONS[section] = _section
    base.entry(section, rank, world, init_file, out_dir)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_ranks(entry, "ext_recipe", WORLD, tmp_path_factory.mktemp("ext"), 300.0)


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


@pytest.mark.parametrize("kind", ["tp", "sp", "fsdp"])
def test_two_ranks_train_as_one_process(two_ranks, kind):
    """Tensor parallel, sequence parallel and FSDP2 (weights gathered quantized) on two
    ranks against one process: the same codes and scales, so the same training up to the
    FP32 rounding of sums split across ranks (an all-reduce, a reduce-scatter)."""
    want = two_ranks[0]["single"]
    losses = [result[kind]["losses"] for result in two_ranks]
    # Data parallel (FSDP2): each rank's loss is its share of the batch's.
    total = torch.stack(losses).sum(0) if kind == "fsdp" else losses[0]
    torch.testing.assert_close(total, want["losses"], rtol=1e-5, atol=0)
    for result in two_ranks:
        assert _max_rel(result[kind]["params"], want["params"]) < 1e-5


def test_the_gathers_carry_codes(two_ranks):
    for result in two_ranks:
        assert result["sp_uint8_gathers"] >= 2  # each step's forward gather of the input
        assert result["fsdp_wrapped"] == 2
        # Each step's forward GEMMs (2 layers) take the gathered codes as they are (the
        # input gradient's GEMM, the column-wise layout saved in forward).
        assert result["fsdp_direct"] == 2 * 2
