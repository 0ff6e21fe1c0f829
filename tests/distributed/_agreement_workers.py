"""Worker processes for ``test_recipe_agreement.py``: ranks that quantize with different
recipes (2 gloo ranks), on each path whose collectives depend on the recipe, and ranks
that agree (what the check costs them).

One spawn, ``agreement``: each case runs in a thread of its own (``isolated``: a fresh
delayed-scaling registry) and records the error each rank raised. A refused case leaves
the process group usable (the check's collective completed on every rank), so the next
case runs on the same group; a regression that hangs again ends in the process group's
timeout (``PG_TIMEOUT``) rather than the test's.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import _dist_workers as base
import torch
import torch.distributed as dist
from _dist_workers import (
    TP_IN,
    WIDTH,
    _tp,
    fc_linears,
    global_batch,
    isolated,
    local_rows,
    make_mlp,
    make_tp_mlp,
    tp_batch,
)
from torch import nn

import fastcast as fc

# Rank r's recipe in the mismatched cases: a per-tensor one against a block-scaled one,
# whose collectives differ in size and number.
MISMATCHED = (
    lambda: fc.Float8CurrentScaling(),
    lambda: fc.MXFP8BlockScaling(),
)
# A short process-group timeout: without the check these cases block in a collective
# until it expires.
PG_TIMEOUT = datetime.timedelta(seconds=60)
STEPS = 3


def entry(section: str, rank: int, world: int, init_file: str, out_dir: str) -> None:
    base.PG_TIMEOUT = PG_TIMEOUT  # read by base.entry when it creates the group
    base.entry(section, rank, world, init_file, out_dir)


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _fully_shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = _mesh()
    for m in fc_linears(model):
        fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _error_of(step: Any) -> str:
    """The message of the RuntimeError ``step()`` raises ('' if none)."""
    try:
        step()
    except RuntimeError as e:
        return str(e)
    return ""


def _train(model: nn.Module, recipe: Any, x: torch.Tensor, group: Any = None) -> None:
    with fc.autocast(recipe=recipe, amax_reduction_group=group):
        loss = model(x).float().square().mean()
    loss.backward()


def fsdp_convert_case(rank: int, world: int) -> str:
    """FSDP2 with the quantized all-gather, each rank's weights converted for its own
    recipe; the autocast's recipe is the same on both ranks (the gathers differ)."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    torch.manual_seed(0)
    model = _fully_shard(fc.convert(model, recipe=MISMATCHED[rank](), quantized_all_gather=True))
    x = local_rows(global_batch(0, world)[0], rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an autocast recipe that is not the gathered one)
        return _error_of(lambda: _train(model, fc.Float8CurrentScaling(), x))


def fsdp_autocast_case(rank: int, world: int) -> str:
    """FSDP2 (high-precision gathers), each rank's autocast with its own recipe, the
    amaxes reduced over the world."""
    model = _fully_shard(make_mlp())
    x = local_rows(global_batch(0, world)[0], rank)
    return _error_of(lambda: _train(model, MISMATCHED[rank](), x, dist.group.WORLD))


def tp_case(rank: int, world: int) -> str:
    """Tensor parallelism (ColwiseParallel then RowwiseParallel), no reduction group."""
    model = _tp(make_tp_mlp())
    return _error_of(lambda: _train(model, MISMATCHED[rank](), tp_batch(0)[0]))


def sp_case(rank: int, world: int) -> str:
    """Sequence parallelism: the first layer's input sequence-sharded, gathered quantized
    (``QuantizedColwiseParallel``) under each rank's recipe."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module  # noqa: PLC0415

    from fastcast.distributed.sequence_parallel import QuantizedColwiseParallel  # noqa: PLC0415

    plan = {
        "0": QuantizedColwiseParallel(input_layouts=Shard(1)),
        "2": RowwiseParallel(output_layouts=Shard(1)),
    }
    model = parallelize_module(make_tp_mlp(), _mesh(), plan)
    x = torch.randn(2, 64, TP_IN, generator=torch.Generator().manual_seed(rank))
    return _error_of(lambda: _train(model, MISMATCHED[rank](), x))


class CountingChecks:
    """Counts the agreement module's collectives (its ``exchange``) while entered."""

    def __init__(self) -> None:
        from fastcast.distributed import agreement  # noqa: PLC0415

        self.module = agreement
        self.calls = 0
        self._orig = agreement.exchange

    def __enter__(self) -> CountingChecks:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._orig(*args, **kwargs)

        self.module.exchange = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        self.module.exchange = self._orig


# The agreeing runs' recipe per path: each its own, since agreed (group, recipe) pairs are
# kept for the process (the paths share the world group).
AGREEING = {
    "fsdp_convert": fc.Float8CurrentScaling,
    "fsdp_autocast": fc.Float8RowwiseScaling,
    "tp": fc.MXFP8BlockScaling,
}


def agreeing_case(rank: int, world: int) -> dict[str, Any]:
    """Ranks on one recipe: STEPS training steps on each path, counting the checks'
    collectives per step (one per group and recipe, on the first step)."""
    out: dict[str, Any] = {}
    x = local_rows(global_batch(0, world)[0], rank)
    builds = {
        "fsdp_convert": lambda: _fully_shard(
            fc.convert(make_mlp(), recipe=AGREEING["fsdp_convert"](), quantized_all_gather=True)
        ),
        "fsdp_autocast": lambda: _fully_shard(make_mlp()),
        "tp": lambda: _tp(make_tp_mlp()),
    }
    for name, build in builds.items():
        model = build()
        data = tp_batch(0)[0] if name == "tp" else x
        group = dist.group.WORLD if name == "fsdp_autocast" else None
        counts = []
        for _ in range(STEPS):
            with CountingChecks() as counter:
                # A new recipe object every step, equal to the first: agreed by value.
                _train(model, AGREEING[name](), data, group)
            counts.append(counter.calls)
        out[name] = torch.tensor(counts)
    return out


def section_agreement(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "recipes": [repr(make()) for make in MISMATCHED],
    }
    for name, case in (
        ("fsdp_convert", fsdp_convert_case),
        ("fsdp_autocast", fsdp_autocast_case),
        ("tp", tp_case),
        ("sp", sp_case),
    ):
        out[f"{name}.error"] = isolated(case, rank, world)
    out["agreeing"] = isolated(agreeing_case, rank, world)
    return out


base.SECTIONS["agreement"] = section_agreement
