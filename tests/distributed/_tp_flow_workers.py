"""Workers of test_tp_flows.py: user flows on a tensor-parallel converted MLP, two ranks.

Importing this module registers its section in ``_dist_workers.SECTIONS`` (a spawned
process imports its target's module, so that one's ``entry`` finds it).
"""

from __future__ import annotations

from typing import Any

import _dist_workers as base
import torch
import torch.distributed as dist
from _dist_workers import TP_RECIPES, _full, _tp, isolated, layer_states, make_tp_mlp, tp_batch
from torch.utils.checkpoint import checkpoint

import fastcast as fc

# Recipes of the flows: per-tensor with and without state, row-wise, a block format.
FLOW_RECIPES = ("current", "delayed", "rowwise", "mxfp8")
CHECKPOINT_MODES = {"plain": None, "reentrant": True, "non_reentrant": False}


def entry(section: str, rank: int, world: int, init_file: str, out_dir: str) -> None:
    base.entry(section, rank, world, init_file, out_dir)


def checkpointed_training(recipe_name: str, mode: str, parallel: bool) -> dict[str, Any]:
    """3 SGD steps of the MLP with its forward under ``torch.utils.checkpoint`` (``mode``:
    reentrant or not; ``plain``: no checkpointing): losses, gradients of every step,
    parameters after, delayed-scaling states."""
    model = make_tp_mlp()
    if parallel:
        model = _tp(model)
    recipe = TP_RECIPES[recipe_name]()
    group = dist.group.WORLD if parallel else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(3):
        x, y = tp_batch(step)
        x = x.requires_grad_()  # the reentrant form needs an input that requires grad
        with fc.autocast(recipe=recipe, amax_reduction_group=group):
            if CHECKPOINT_MODES[mode] is None:
                out = model(x)
            else:
                out = checkpoint(model, x, use_reentrant=CHECKPOINT_MODES[mode])
        loss = (out - y).square().mean()
        loss.backward()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        grads[-1]["input"] = x.grad.detach().clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_full(loss))
    return {
        "losses": torch.stack(losses),
        "grads": grads,
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "states": layer_states(model) if recipe_name == "delayed" else [],
    }


def calibrated(parallel: bool) -> dict[str, Any]:
    """DelayedScaling calibrated (``enabled=False, calibrating=True``) on two batches,
    then one training step: the states after calibration, the step's loss."""
    model = make_tp_mlp()
    if parallel:
        model = _tp(model)
    recipe = fc.DelayedScaling(amax_history_len=4)
    group = dist.group.WORLD if parallel else None
    with torch.no_grad():
        for step in (5, 6):
            x = tp_batch(step)[0]
            with fc.autocast(recipe=recipe, enabled=False, calibrating=True,
                             amax_reduction_group=group):  # fmt: skip
                plain = model(x)
    states = layer_states(model)
    x, y = tp_batch(0)
    with fc.autocast(recipe=recipe, amax_reduction_group=group):
        loss = (model(x) - y).square().mean()
    loss.backward()
    return {"states": states, "plain": _full(plain), "loss": _full(loss).detach()}


def calibration_without_group() -> str:
    """DelayedScaling calibrated on a tensor-parallel layer without a reduction group:
    refused (each rank would record only its shard's amax)."""
    model = _tp(make_tp_mlp())
    try:
        with torch.no_grad(), fc.autocast(recipe=fc.DelayedScaling(), enabled=False,
                                          calibrating=True):  # fmt: skip
            model(tp_batch(0)[0])
    except ValueError as exc:
        return str(exc)
    return "not refused"


def row_parallel_output(recipe_name: str) -> dict[str, Any]:
    """A bias-free ``RowwiseParallel`` layer whose output is sequence-sharded
    (``output_layouts=Shard(1)``) against the same layer's replicated output: the
    collectives each runs, forward and backward (counted at DTensor's functional
    collectives), and the outputs."""
    import torch.distributed._functional_collectives as funcol  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    recipe = TP_RECIPES[recipe_name]()
    out: dict[str, Any] = {}
    for layout in ("replicate", "shard"):
        torch.manual_seed(7)
        model = fc.convert(torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False)))
        placement = Shard(1) if layout == "shard" else Replicate()
        parallelize_module(model, mesh, {"0": RowwiseParallel(output_layouts=placement)})
        calls: dict[str, int] = {"all_reduce": 0, "reduce_scatter_single": 0}
        saved = {name: getattr(funcol, name) for name in calls}

        def counting(name: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return saved[name](*args, **kwargs)

            return call

        # The rank's shard of the [2, 32, 256] input (RowwiseParallel's input_layouts).
        x = (tp_batch(0)[0] * (1 + dist.get_rank())).requires_grad_()
        for name in calls:
            setattr(funcol, name, counting(name))
        try:
            with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                y = model(x)
            y.square().sum().backward()
        finally:
            for name, fn in saved.items():
                setattr(funcol, name, fn)
        out[layout] = {"y": y.detach().clone(), "calls": calls}
    return out


def section_tp_flows(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, name in enumerate(FLOW_RECIPES):
        for mode in CHECKPOINT_MODES:
            out[f"{name}.{mode}"] = isolated(checkpointed_training, name, mode, True)
        if i % world == rank:  # single-process references, shared out over the ranks
            out[f"{name}.reference"] = isolated(checkpointed_training, name, "plain", False)
    out["calibrated"] = isolated(calibrated, True)
    out["calibration_without_group"] = isolated(calibration_without_group)
    for name in ("current", "mxfp8"):
        out[f"row_output.{name}"] = isolated(row_parallel_output, name)
    if rank == 0:
        out["calibrated.reference"] = isolated(calibrated, False)
    return out


base.SECTIONS["tp_flows"] = section_tp_flows
