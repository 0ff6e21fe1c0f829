"""Worker processes for ``test_mesh2d.py``: FSDP2 x TP on a 2x2 mesh, DCP resharded to
1 and 4 ranks, gradient accumulation under FSDP2 (gloo, CPU).

``entry`` is ``_dist_workers.entry`` (process group, result files, tracebacks) over this
module's sections, which it adds to ``_dist_workers.SECTIONS``: a spawned process imports
its target's module, so importing this one registers them there. Two spawns:

- ``mesh_save`` (2 ranks): every recipe's FSDP2 and tensor-parallel MLP trained 2 steps
  and saved with DCP into ``$FASTCAST_MESH_CKPT``; rank 0 loads each checkpoint into one
  unsharded model; gradient accumulation with ``is_first_microbatch`` under FSDP2;
- ``mesh2d`` (4 ranks): FSDP2 x TP training on a ``(dp=2, tp=2)`` mesh for every recipe
  against one process, and the ``mesh_save`` checkpoints loaded on 4 ranks.
"""

from __future__ import annotations

import os
from typing import Any

import _dist_workers as base
import torch
import torch.distributed as dist
from _dist_workers import TP_IN, TP_RECIPES, _full, fc_linears, isolated, layer_states, make_tp_mlp
from torch import nn

import fastcast as fc

# The six recipes (NVFP4 without stochastic rounding: its draws are each shard's own).
RECIPES = ("current", "delayed", "rowwise", "block", "mxfp8", "nvfp4")
DP, TP = 2, 2
STEPS = 3
SEQ = 64  # tokens per sequence; each data-parallel rank trains on 2 sequences (128 tokens)
LR = 0.1
# Where the scale of a quantized block runs along the tokens (the column-wise layouts of
# the weight-gradient GEMM), a data-parallel rank scales its own tokens, as under DDP:
# row-wise scaling's per-feature column scales and NVFP4's per-tensor FP32 scale of the
# input and gradient. Their single-process reference runs each data-parallel rank's
# rows as one micro-batch (gradients accumulated); the others' the whole batch at once
# (per-tensor amaxes are reduced over the autocast's group; block and MXFP8 blocks end
# on the ranks' 128-token boundary).
MICRO_REFERENCE = ("rowwise", "nvfp4")


def entry(section: str, rank: int, world: int, init_file: str, out_dir: str) -> None:
    base.entry(section, rank, world, init_file, out_dir)


def mesh_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's ``[4, 64, 128]`` inputs and targets; data-parallel rank ``d`` takes
    sequences ``2d:2d+2``, scaled by ``4**d`` (so the ranks' amaxes differ)."""
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(2 * DP, SEQ, TP_IN, generator=g)
    scale = torch.repeat_interleave(4.0 ** torch.arange(DP), 2).view(-1, 1, 1)
    return x * scale, torch.randn(2 * DP, SEQ, TP_IN, generator=g)


def dp_rows(t: torch.Tensor, d: int) -> torch.Tensor:
    return t[2 * d : 2 * d + 2]


def _parallelize(model: nn.Module, tp_mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _shard(model: nn.Module, dp_mesh: Any, **kwargs: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    for m in fc_linears(model):
        fully_shard(m, mesh=dp_mesh, **kwargs)
    return fully_shard(model, mesh=dp_mesh, **kwargs)


def _mesh_2d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def _mesh_1d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _first_layer_hook(model: nn.Module, store: list) -> Any:
    def hook(module: Any, args: Any, out: torch.Tensor) -> None:
        store.append(_full(out))

    return model[0].register_forward_hook(hook)


# -- 2-D: FSDP2 over "dp" x tensor parallelism over "tp" ------------------------------------


def mesh2d_training(name: str) -> dict[str, Any]:
    """ColwiseParallel/RowwiseParallel over the mesh's "tp" dim, then ``fully_shard`` over
    its "dp" dim; 3 SGD steps on this data-parallel rank's sequences (the loss is their
    share of the global one: squared error summed over the rank's rows, over the global
    count): per-step losses, the first layer's output in the first step (this rank's rows
    and columns), first-step gradients and parameters after (full tensors)."""
    mesh = _mesh_2d()
    d = mesh.get_local_rank("dp")
    model = _shard(_parallelize(make_tp_mlp(), mesh["tp"]), mesh["dp"])
    recipe = TP_RECIPES[name]()
    # FSDP2 averages the data-parallel ranks' gradients: each is its share of the sum.
    opt = torch.optim.SGD(model.parameters(), lr=LR * DP)
    first: list[torch.Tensor] = []
    handle = _first_layer_hook(model, first)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = (dp_rows(t, d) for t in mesh_batch(step))
        with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            out = model(x)
        loss = (out - y).square().sum() / (y.numel() * DP)
        loss.backward()
        if step == 0:
            handle.remove()
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    res = {
        "losses": torch.stack(losses),
        "first_layer": first[0],
        "grads": grads,
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "weight_meshes": [list(m.weight.device_mesh.mesh_dim_names) for m in fc_linears(model)],
    }
    if name == "delayed":
        res["states"] = layer_states(model)
    return res


def mesh_reference(name: str) -> dict[str, Any]:
    """The same 3 steps in one process: the whole batch at once, or (``MICRO_REFERENCE``)
    each data-parallel rank's sequences as a micro-batch, gradients accumulated."""
    model = make_tp_mlp()
    recipe = TP_RECIPES[name]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    first: list[torch.Tensor] = []
    handle = _first_layer_hook(model, first)
    micro = name in MICRO_REFERENCE
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = mesh_batch(step)
        parts = [(dp_rows(x, d), dp_rows(y, d)) for d in range(DP)] if micro else [(x, y)]
        total = torch.zeros(())
        for xp, yp in parts:
            with fc.autocast(recipe=recipe):
                out = model(xp)
            loss = (out - yp).square().sum() / y.numel()
            loss.backward()
            total += loss.detach()
        if step == 0:
            handle.remove()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    res = {
        # Each data-parallel rank's rows of the first layer's first output.
        "first_layer": first if micro else [dp_rows(first[0], d) for d in range(DP)],
        "losses": torch.stack(losses),
        "grads": grads,
        "params": {n: _full(p) for n, p in model.named_parameters()},
    }
    if name == "delayed":
        res["states"] = layer_states(model)
    return res


def _quantized_gather_2d() -> str:
    """``quantized_all_gather=True`` on a 2-D FSDP2 x TP model: the error of its forward."""
    mesh = _mesh_2d()
    recipe = fc.Float8CurrentScaling()
    torch.manual_seed(4321)
    model = fc.convert(
        nn.Sequential(nn.Linear(TP_IN, 256), nn.ReLU(), nn.Linear(256, TP_IN)),
        recipe=recipe,
        quantized_all_gather=True,
    )
    model = _shard(_parallelize(model, mesh["tp"]), mesh["dp"])
    x = dp_rows(mesh_batch(0)[0], mesh.get_local_rank("dp"))
    try:
        with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            model(x)
    except NotImplementedError as e:
        return str(e)
    return ""


def _ungathered_call_2d() -> str:
    """A 2-D model ``fully_shard``-ed at its root only: after a forward and a reshard,
    the first layer called by itself (its weight FSDP2's 2-D shard, not gathered): the
    error."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = _mesh_2d()
    recipe = fc.Float8CurrentScaling()
    model = fully_shard(_parallelize(make_tp_mlp(), mesh["tp"]), mesh=mesh["dp"])
    x = dp_rows(mesh_batch(0)[0], mesh.get_local_rank("dp"))
    with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
        model(x)
        model.reshard()  # (the root keeps its weights gathered after a forward)
        try:
            model[0](x)
        except NotImplementedError as e:
            return str(e)
    return ""


# -- DCP: saved on 2 ranks, loaded on 1 and on 4 ---------------------------------------------

# Wide enough that 4 tensor-parallel shards of the hidden layer (128) are whole blocks of
# every block-scaled recipe.
DCP_HIDDEN = 512
DCP_STEPS = 2


def _dcp_path(kind: str, name: str) -> str:
    return os.path.join(os.environ["FASTCAST_MESH_CKPT"], f"{kind}_{name}")


def _eval_input() -> torch.Tensor:
    return torch.randn(2, 32, TP_IN, generator=torch.Generator().manual_seed(31))


def _forward(model: nn.Module, name: str, group: Any) -> torch.Tensor:
    """The model's output for ``_eval_input`` (the same on every rank) under autocast."""
    with fc.autocast(recipe=TP_RECIPES[name](), amax_reduction_group=group), torch.no_grad():
        return _full(model(_eval_input()))


def _dcp_model(kind: str) -> nn.Module:
    """A fresh MLP (converted without a recipe), FSDP2- or tensor-parallel over all ranks."""
    model = make_tp_mlp(DCP_HIDDEN)
    return _shard(model, _mesh_1d()) if kind == "fsdp" else _parallelize(model, _mesh_1d())


def dcp_save(kind: str, name: str, rank: int, world: int) -> dict[str, Any]:
    """Train the ``kind`` model 2 steps (FSDP2: each rank its own sequences; TP: the same
    batch on both ranks), save it with DCP; then its parameters, delayed states and
    forward, and (rank 0) those of one unsharded model loaded from the checkpoint."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    import fastcast.dcp  # noqa: PLC0415

    recipe = TP_RECIPES[name]()
    group = dist.group.WORLD
    model = _dcp_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(DCP_STEPS):
        x, y = mesh_batch(step)
        if kind == "fsdp":
            x, y = dp_rows(x, rank), dp_rows(y, rank)
        with fc.autocast(recipe=recipe, amax_reduction_group=group):
            out = model(x)
        (out - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    # Saved before any forward: a delayed-scaling forward updates the histories it saves.
    dcp.save({"model": model.state_dict()}, checkpoint_id=_dcp_path(kind, name))
    out: dict[str, Any] = {"params": {n: _full(p) for n, p in model.named_parameters()}}
    out["states"] = layer_states(model) if name == "delayed" else []
    out["forward"] = _forward(model, name, group)
    dist.barrier()
    if rank == 0:  # one process, no process group: the whole tensors
        single = make_tp_mlp(DCP_HIDDEN)
        sd = {"model": single.state_dict()}
        fastcast.dcp.load(sd, checkpoint_id=_dcp_path(kind, name), no_dist=True)
        single.load_state_dict(sd["model"])
        out["single_params"] = {n: _full(p) for n, p in single.named_parameters()}
        out["single_states"] = layer_states(single) if name == "delayed" else []
        out["single"] = _forward(single, name, None)
    dist.barrier()
    return out


def dcp_load(kind: str, name: str) -> dict[str, Any]:
    """The ``mesh_save`` checkpoint loaded into a fresh ``kind`` model over all (4) ranks:
    parameters, delayed states, forward."""
    import fastcast.dcp  # noqa: PLC0415

    model = _dcp_model(kind)
    for p in model.parameters():  # other values, so that the load must write them all
        p.data.mul_(0.5)
    sd = {"model": model.state_dict()}
    fastcast.dcp.load(sd, checkpoint_id=_dcp_path(kind, name))
    model.load_state_dict(sd["model"])
    return {
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "states": layer_states(model) if name == "delayed" else [],
        "forward": _forward(model, name, dist.group.WORLD),
        "local_rows": model[0].weight.to_local().shape[0],
    }


# -- gradient accumulation under FSDP2 ---------------------------------------------------------

ACC_RECIPES = ("current", "delayed", "mxfp8")
MICRO = 2  # micro-batches per step


class _Pair(nn.Module):
    """Two fc.Linear with a ReLU between; ``first`` goes to both as
    ``is_first_microbatch``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2024)
        self.a, self.b = nn.Linear(TP_IN, 256), nn.Linear(256, TP_IN)

    def forward(self, x: torch.Tensor, first: bool | None = None) -> torch.Tensor:
        return self.b(torch.relu(self.a(x, is_first_microbatch=first)), is_first_microbatch=first)


def accumulation_run(name: str, flags: bool, rank: int | None, world: int) -> dict[str, Any]:
    """3 steps of 2 micro-batches each (``flags``: ``is_first_microbatch`` True then
    False; else None), the gradients accumulated. ``rank=None``: one process, each
    micro-batch all ranks' sequences; else FSDP2 over all ranks with
    ``reshard_after_forward=False`` and ``set_reshard_after_backward(False)`` (the
    weights stay gathered across the micro-batches), each rank its own sequences.

    Also: whether the second micro-batch's GEMMs took the weight quantized in the first
    (the kept object)."""
    recipe = TP_RECIPES[name]()
    model = fc.convert(_Pair())
    sharded = rank is not None
    if sharded:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        mesh = _mesh_1d()
        for m in (model.a, model.b):
            fully_shard(m, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        model.set_reshard_after_backward(False)
    group = dist.group.WORLD if sharded else None
    opt = torch.optim.SGD(model.parameters(), lr=LR * world if sharded else LR)
    losses, kept = [], []
    for step in range(STEPS):
        x, y = mesh_batch(step)
        for i in range(MICRO):
            # Micro-batch i: sequence i of each data-parallel rank's pair.
            xs, ys = x[i::2], y[i::2]
            if sharded:
                xs, ys = xs[rank : rank + 1], ys[rank : rank + 1]
            flag = (i == 0) if flags else None
            with fc.autocast(recipe=recipe, amax_reduction_group=group):
                out = model(xs, flag)
            if i == 0:
                held = [m._weight_cache.entry for m in (model.a, model.b)]
            else:
                now = [m._weight_cache.entry for m in (model.a, model.b)]
                kept.append(all(h is not None and n is h for h, n in zip(held, now)))
            loss = (out - ys).square().sum() / y[i::2].numel()
            if sharded:  # gathered weights kept until the last micro-batch's backward
                model.set_reshard_after_backward(i == MICRO - 1)
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    res: dict[str, Any] = {
        "losses": torch.stack(losses),
        "kept": kept,
        "params": {n: _full(p) for n, p in model.named_parameters()},
    }
    return res


# Rounds: FSDP2 gathering into the old memory depends on the allocator (it happened in
# at least one of 6 rounds on either rank in all runs here but one, under
# ATEN_CPU_CAPABILITY=default); 12 make a run without it unlikely.
CHANGES = 12


def changed_weight(name: str, sharded: bool) -> dict[str, Any]:
    """``CHANGES`` times: a micro-batch keeps the quantized weight
    (``is_first_microbatch=True``); the weight changes in place with no optimizer step
    (FSDP2: ``reshard()``, the shard scaled, gathered again by the next forward, whose copy
    into the unsharded weight keeps its version counter and often its memory); then a
    micro-batch with ``is_first_microbatch=False`` and one that quantizes afresh (True).
    Their outputs, and whether the gathered weight was at the same address as before."""
    recipe = TP_RECIPES[name]()
    torch.manual_seed(3)
    model = fc.convert(nn.Linear(64, 64))
    if sharded:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        fully_shard(model, mesh=_mesh_1d(), reshard_after_forward=False)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    group = dist.group.WORLD if sharded else None
    after, fresh, same = [], [], []
    for _ in range(CHANGES):
        with fc.autocast(recipe=recipe, amax_reduction_group=group), torch.no_grad():
            model(x, is_first_microbatch=True)
            address = model.weight.data_ptr()  # (FSDP2: the gathered weight, in forward)
            if sharded:
                model.reshard()
            model.weight.mul_(0.5)
            after.append(model(x, is_first_microbatch=False))
            same.append(model.weight.data_ptr() == address)
            fresh.append(model(x, is_first_microbatch=True))
    return {"after_change": after, "after_change_fresh": fresh, "same_address": same}


# -- torch.compile of an FSDP2 model under fc.autocast ------------------------------------------


def compiled_fsdp(quantized: bool, compiled: bool, rank: int) -> dict[str, Any]:
    """The FSDP2 MLP under DelayedScaling over the world group, eager or
    ``torch.compile``-d, 2 SGD steps: outputs and gradients, or the error's text, and the
    autocast state after it."""
    from fastcast.runtime.state import BOTTOM, get_stack  # noqa: PLC0415

    recipe = fc.DelayedScaling(amax_history_len=4)
    model = fc.convert(make_tp_mlp(), recipe=recipe, quantized_all_gather=quantized)
    model = _shard(model, _mesh_1d())
    run = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    res: dict[str, Any] = {"outs": [], "grads": [], "error": ""}
    try:
        for step in range(2):
            x, y = (dp_rows(t, rank) for t in mesh_batch(step))
            with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                out = run(x)
            (out - y).square().mean().backward()
            res["outs"].append(out.detach())
            res["grads"].append([_full(p.grad) for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
    except RuntimeError as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["autocast_closed"] = get_stack() is BOTTOM  # no autocast level left open
    return res


# -- sections ---------------------------------------------------------------------------------


def section_mesh_save(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("fsdp", "tp"):
        for name in RECIPES:
            out[f"{kind}.{name}"] = isolated(dcp_save, kind, name, rank, world)
    for name in ACC_RECIPES:
        out[f"acc.{name}"] = isolated(accumulation_run, name, True, rank, world)
        out[f"acc.{name}.no_flags"] = isolated(accumulation_run, name, False, rank, world)
        out[f"changed.{name}"] = isolated(changed_weight, name, True)
        if rank == 0:
            out[f"acc.{name}.reference"] = isolated(accumulation_run, name, True, None, world)
            out[f"changed.{name}.reference"] = isolated(changed_weight, name, False)
    return out


def section_mesh2d(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, name in enumerate(RECIPES):
        out[name] = isolated(mesh2d_training, name)
        if i % world == rank:  # the single-process references, shared out over the ranks
            out[f"{name}.reference"] = isolated(mesh_reference, name)
    out["quantized_gather_error"] = isolated(_quantized_gather_2d)
    out["ungathered_error"] = isolated(_ungathered_call_2d)
    for kind in ("fsdp", "tp"):
        for name in RECIPES:
            out[f"load.{kind}.{name}"] = isolated(dcp_load, kind, name)
    return out


def section_mesh_compile(rank: int, world: int) -> dict[str, Any]:
    return {
        f"{'fp8' if q else 'hp'}.{'compiled' if c else 'eager'}": isolated(
            compiled_fsdp, q, c, rank
        )
        for q in (False, True)
        for c in (False, True)
    }


base.SECTIONS["mesh_save"] = section_mesh_save
base.SECTIONS["mesh_compile"] = section_mesh_compile
base.SECTIONS["mesh2d"] = section_mesh2d
