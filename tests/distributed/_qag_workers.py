"""Worker processes for ``test_fsdp_qag_more.py``: FSDP2's quantized all-gather with
gradient accumulation (``is_first_microbatch``), on 4 ranks, with uneven shards, under
``torch.compile`` and through DCP (gloo, CPU).

``entry`` is ``_dist_workers.entry`` over this module's sections, which it adds to
``_dist_workers.SECTIONS`` (a spawned process imports its target's module, so importing
this one registers them there).
"""

from __future__ import annotations

import functools
from typing import Any

import _dist_workers as base
import torch
import torch.distributed as dist
from _dist_workers import LOCAL_BATCH, _plain, fc_linears, full_params, isolated
from torch import nn

import fastcast as fc

# Every built-in recipe (NVFP4 without stochastic rounding: its draws are each rank's own).
RECIPES = {
    "current": lambda: fc.Float8CurrentScaling(),
    "delayed": lambda: fc.DelayedScaling(amax_history_len=4),
    "rowwise": lambda: fc.Float8RowwiseScaling(),
    "block": lambda: fc.Float8BlockScaling(),
    "mxfp8": lambda: fc.MXFP8BlockScaling(),
    "nvfp4": lambda: fc.NVFP4BlockScaling(stochastic_rounding=False),
}
# Recipes whose activation scales run along the tokens per rank (row-wise scaling's
# per-feature column scales, Float8BlockScaling's 128-token tiles, NVFP4's tensor scale):
# their single-process reference runs each rank's rows as a micro-batch of its own, as
# data parallelism computes them. The others' reference runs all ranks' rows at once
# (per-tensor amaxes are reduced over the autocast's group; MXFP8's 32-token blocks end
# on the ranks' boundaries).
PER_RANK_REFERENCE = ("rowwise", "block", "nvfp4")
LR = 0.05
STEPS = 3


def entry(section: str, rank: int, world: int, init_file: str, out_dir: str) -> None:
    base.entry(section, rank, world, init_file, out_dir)


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard(model: nn.Module, **kwargs: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = _mesh()
    for m in fc_linears(model):
        fully_shard(m, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


class GatherCounter:
    """Counts ``FSDPFloat8Weight.fsdp_pre_all_gather`` calls (each quantizes a shard for
    FSDP2's all-gather) and the GEMM operands taken from gathered weights as they are
    (``fc_quantized`` returning the gathered quantized weight)."""

    def __init__(self) -> None:
        from fastcast.distributed.fsdp import GATHERED, FSDPFloat8Weight  # noqa: PLC0415

        self.gathers = 0
        self.direct = 0
        self._saved: list[tuple[type, str, Any]] = []
        self._targets = [(FSDPFloat8Weight, "fsdp_pre_all_gather")] + [
            (cls, "fc_quantized") for cls in GATHERED
        ]

    def __enter__(self) -> GatherCounter:
        for cls, name in self._targets:
            orig = getattr(cls, name)
            self._saved.append((cls, name, orig))
            setattr(cls, name, self._wrap(orig, name))
        return self

    def _wrap(self, orig: Any, name: str) -> Any:
        @functools.wraps(orig)  # (FSDP2 checks the hook's signature)
        def wrapped(this: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(this, *args, **kwargs)
            if name == "fsdp_pre_all_gather":
                self.gathers += 1
            elif out is not None:
                self.direct += 1
            return out

        return wrapped

    def __exit__(self, *exc: Any) -> None:
        for cls, name, orig in self._saved:
            setattr(cls, name, orig)


# -- 1. gradient accumulation: is_first_microbatch with the quantized gather ---------------

# 2 ranks: 256 rows split into shards of 128, whole blocks of every recipe (128x128 tiles).
ACC_SIZES = (128, 256, 256)
MICRO = 2  # micro-batches per step


class AccPair(nn.Module):
    """Two fc.Linear with a ReLU between; ``first`` goes to both as ``is_first_microbatch``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4242)
        self.a = nn.Linear(ACC_SIZES[0], ACC_SIZES[1])
        self.b = nn.Linear(ACC_SIZES[1], ACC_SIZES[2])

    def forward(self, x: torch.Tensor, first: bool | None = None) -> torch.Tensor:
        return self.b(torch.relu(self.a(x, is_first_microbatch=first)), is_first_microbatch=first)


def acc_batch(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of step ``step``: ``world`` x 32 tokens, rank r's rows (``r*32``
    on) scaled by ``4**r`` so that the ranks' amaxes differ."""
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    x = torch.randn(world * LOCAL_BATCH, ACC_SIZES[0], generator=g)
    scale = torch.repeat_interleave(4.0 ** torch.arange(world), LOCAL_BATCH).unsqueeze(1)
    return x * scale, torch.randn(world * LOCAL_BATCH, ACC_SIZES[-1], generator=g)


def rows_of(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


# mode -> (quantized_all_gather, reshard_after_forward, keep gathered after backward)
ACC_MODES = {
    # FSDP2 keeps the weights gathered for the whole step: one gather, both layouts.
    "keep": (True, False, True),
    "keep_hp": (False, False, True),
    # FSDP2's defaults: every micro-batch gathers in forward and again in backward.
    "regather": (True, True, False),
    "regather_hp": (False, True, False),
    # Gathered again in backward and kept after it: the next micro-batch's forward finds
    # the weight backward's re-gather left (split layouts: the column-wise one).
    "after_backward": (True, True, True),
}


def accumulation(name: str, mode: str, rank: int | None, world: int) -> dict[str, Any]:
    """``STEPS`` SGD steps of ``MICRO`` micro-batches, ``is_first_microbatch`` True for the
    first and False for the others, gradients accumulated. Sharded (``rank``): FSDP2 as
    ``ACC_MODES[mode]`` says, gradient sync (``set_requires_gradient_sync``) on the last
    micro-batch only, each rank its rows. One process (``rank=None``): all ranks' rows of
    each micro-batch (``PER_RANK_REFERENCE``: each rank's rows as a micro-batch of its
    own), the flag True only for the step's first call.

    The losses (per micro-batch, summed over the rows at hand over the global count), the
    parameters after the steps, and per step the gathers (``fsdp_pre_all_gather`` calls)
    and the GEMMs that took a gathered quantized weight."""
    recipe = RECIPES[name]()
    sharded = rank is not None
    quantized, reshard_fwd, keep_after_bwd = ACC_MODES[mode] if sharded else (False, 0, 0)
    model = fc.convert(AccPair(), recipe=recipe, quantized_all_gather=quantized, keep_head=False)
    if sharded:
        model = _shard(model, reshard_after_forward=reshard_fwd)
    group = dist.group.WORLD if sharded else None
    # FSDP2 averages the ranks' gradients, one process sums them: lr * world.
    opt = torch.optim.SGD(model.parameters(), lr=LR * world if sharded else LR)
    losses, gathers, direct = [], [], []
    for step in range(STEPS):
        with GatherCounter() as counter:
            for i in range(MICRO):
                x, y = acc_batch(step, i, world)
                if sharded:
                    parts = [(rows_of(x, rank), rows_of(y, rank))]
                    last = i == MICRO - 1
                    model.set_requires_gradient_sync(last)
                    if keep_after_bwd:
                        model.set_reshard_after_backward(last)
                elif name in PER_RANK_REFERENCE:
                    parts = [(rows_of(x, r), rows_of(y, r)) for r in range(world)]
                else:
                    parts = [(x, y)]
                for j, (xp, yp) in enumerate(parts):
                    with fc.autocast(recipe=recipe, amax_reduction_group=group):
                        out = model(xp, i == 0 and j == 0)
                    loss = (out - yp).square().sum() / y.numel()
                    loss.backward()
                    losses.append(loss.detach())
        gathers.append(counter.gathers)
        direct.append(counter.direct)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "losses": torch.stack(losses).reshape(STEPS, MICRO, -1).sum(-1),
        "params": _plain(full_params(model)),
        "gathers": gathers,
        "direct": direct,
    }


def section_qag_two(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in RECIPES:
        for mode in ACC_MODES:
            out[f"{name}.{mode}"] = isolated(accumulation, name, mode, rank, world)
        if rank == 0:
            out[f"{name}.reference"] = isolated(accumulation, name, "", None, world)
    for name in RECIPES:
        out[f"dcp.{name}"] = isolated(dcp_run, name, rank, world)
    return out


base.SECTIONS["qag_two"] = section_qag_two


# -- 2. four ranks, every recipe (and 3. uneven shards) -------------------------------------

# 4 ranks: the 512 rows of the first two layers split into shards of 128 (whole blocks of
# every recipe). The last layer's 6 rows do not split into 4 equal shards (FSDP2: 2, 2, 2
# and 0 rows, padded): an fc.Linear for the per-tensor recipes (its codes gathered
# padded), an nn.Linear for the others (fc.convert keeps it: 6 is not a multiple of their
# blocks; FSDP2 gathers it with the root's parameters, in high precision).
FOUR_SIZES = (128, 512, 512, 6)
FOUR_STEPS = 4  # the first STEPS compared; live tensors counted after FOUR_LIVE_AFTER
FOUR_LIVE_AFTER = (1, 2, 4)
PER_TENSOR = ("current", "delayed")


def make_four_mlp(name: str) -> nn.Sequential:
    torch.manual_seed(8642)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(FOUR_SIZES, FOUR_SIZES[1:])):
        last = i == len(FOUR_SIZES) - 2
        linear = fc.Linear if last and name in PER_TENSOR else nn.Linear
        layers += [linear(n_in, n_out)] + ([] if last else [nn.ReLU()])
    return nn.Sequential(*layers)


def four_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``world`` x 32 tokens; rank r's rows scaled by ``2**r``."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(world * LOCAL_BATCH, FOUR_SIZES[0], generator=g)
    scale = torch.repeat_interleave(2.0 ** torch.arange(world), LOCAL_BATCH).unsqueeze(1)
    return x * scale, torch.randn(world * LOCAL_BATCH, FOUR_SIZES[-1], generator=g)


class CallBytes:
    """Wraps ``dist.all_gather_single`` (FSDP2's all-gather): the bytes each call sends,
    in call order, under the phase the training loop sets."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {}
        self.phase = "forward"
        self._orig = dist.all_gather_single

    def __call__(self, output, input, group=None, async_op=False):  # noqa: A002
        self.calls.setdefault(self.phase, []).append(input.numel() * input.element_size())
        return self._orig(output, input, group=group, async_op=async_op)

    def __enter__(self) -> CallBytes:
        dist.all_gather_single = self
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single = self._orig


def four_run(
    name: str,
    quantized: bool,
    rank: int | None,
    world: int,
    start: list[dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """SGD on the MLP, every fc.Linear and the root ``fully_shard``-ed over the ranks,
    each rank its rows (``rank=None``: one process, all rows at once, or each rank's rows
    as a micro-batch for ``PER_RANK_REFERENCE``, gradients accumulated). For each of the
    first ``STEPS`` steps: the loss (per rank), the gradients and the parameters after it;
    the bytes of each of the first step's gathers, the live tensors after
    ``FOUR_LIVE_AFTER`` steps, the warnings, the GEMMs that took a gathered weight.

    ``start`` (the reference): step ``s > 0`` starts from ``start[s - 1]``, the sharded
    run's parameters after step ``s - 1``, instead of its own. A quantizer is a step
    function: an FP32 rounding difference in the parameters (FSDP2's reduce-scatter adds
    in another order) moves an element across an FP8 rounding midpoint now and then, and
    from there the two trajectories differ by FP8 steps, not FP32 rounding. Started from
    the same parameters (SGD keeps no other state; a delayed history records the same
    amaxes from the same parameters), each step differs by the gradient reduction's
    rounding only."""
    import warnings  # noqa: PLC0415

    from _dist_workers import _live_storage  # noqa: PLC0415

    recipe = RECIPES[name]()
    sharded = rank is not None
    model = fc.convert(
        make_four_mlp(name), recipe=recipe, quantized_all_gather=quantized, keep_head=False
    )
    if sharded:
        model = _shard(model)
    group = dist.group.WORLD if sharded else None
    opt = torch.optim.SGD(model.parameters(), lr=LR * world if sharded else LR)
    res: dict[str, Any] = {"losses": [], "grads": [], "params": []}
    with (
        warnings.catch_warnings(record=True) as caught,
        CallBytes() as gathers,
        GatherCounter() as counter,
    ):
        warnings.simplefilter("always")
        for step in range(FOUR_STEPS if sharded else STEPS):
            if start is not None and step > 0:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(start[step - 1][n])
            x, y = four_batch(step % STEPS, world)
            gathers.phase = "forward" if step == 0 else "later"
            if sharded:
                parts = [(rows_of(x, rank), rows_of(y, rank))]
            elif name in PER_RANK_REFERENCE:
                parts = [(rows_of(x, r), rows_of(y, r)) for r in range(world)]
            else:
                parts = [(x, y)]
            losses = []
            for xp, yp in parts:
                with fc.autocast(recipe=recipe, amax_reduction_group=group):
                    loss = (model(xp) - yp).square().sum() / y.numel()
                if step == 0:
                    gathers.phase = "backward"
                loss.backward()
                losses.append(loss.detach())
            if step < STEPS:
                res["grads"].append(
                    {
                        n: (p.grad.full_tensor() if sharded else p.grad).clone()
                        for n, p in model.named_parameters()
                    }
                )
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step < STEPS:
                res["losses"].append(torch.stack(losses).sum())
                res["params"].append(_plain(full_params(model)))
            if sharded and quantized and step + 1 in FOUR_LIVE_AFTER:
                res.setdefault("live", []).append(torch.tensor(_live_storage(res)))
    res["losses"] = torch.stack(res["losses"])
    res["bytes"] = {k: v for k, v in gathers.calls.items() if k != "later"}
    res["direct"] = counter.direct
    res["warnings"] = [str(w.message) for w in caught if "quantized_all_gather" in str(w.message)]
    return res


def section_qag_four(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, name in enumerate(RECIPES):
        out[f"{name}.q"] = isolated(four_run, name, True, rank, world)
        if i % world == rank:  # the single-process references, shared out over the ranks
            start = out[f"{name}.q"]["params"]  # (every rank holds the same parameters)
            out[f"{name}.reference"] = isolated(four_run, name, False, None, world, start)
    return out


base.SECTIONS["qag_four"] = section_qag_four


# -- 4. torch.compile of an FSDP2 model with the quantized gather -------------------------------

# (recipe, reshard_after_forward) under FSDP2's default re-gather: block's 128x128 tiles
# (the "one" layout, whose graph takes the gathered weight) and MXFP8's split layouts.
# Each compiles graphs of its own (seconds each): two cheap recipes. (Both layouts in one
# gather, reshard_after_forward=False, also compile to the eager results: not run here.)
COMPILE_CASES = (("block", True), ("mxfp8", True))


def compiled_run(name: str, reshard: bool, compiled: bool, rank: int, world: int) -> dict:
    """The accumulation test's pair of fc.Linear (shards of whole blocks), FSDP2 with the
    quantized gather, eager or ``torch.compile``-d, 2 SGD steps: outputs, gradients, the
    error's text if any, and the autocast state after."""
    from fastcast.runtime.state import BOTTOM, get_stack  # noqa: PLC0415

    recipe = RECIPES[name]()
    model = fc.convert(AccPair(), recipe=recipe, quantized_all_gather=True, keep_head=False)
    model = _shard(model, reshard_after_forward=reshard)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=LR * world)
    res: dict[str, Any] = {"outs": [], "grads": [], "error": ""}
    try:
        for step in range(2):
            x, y = (rows_of(t, rank) for t in acc_batch(step, 0, world))
            with fc.autocast(recipe=recipe):
                out = run(x)
            (out - y).square().mean().backward()
            res["outs"].append(out.detach())
            res["grads"].append([p.grad.full_tensor() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001 - the test reads the text
        res["error"] = f"{type(e).__name__}: {e}"
    res["autocast_closed"] = get_stack() is BOTTOM
    return res


def section_qag_compile(rank: int, world: int) -> dict[str, Any]:
    return {
        f"{name}.{reshard}.{'compiled' if c else 'eager'}": isolated(
            compiled_run, name, reshard, c, rank, world
        )
        for name, reshard in COMPILE_CASES
        for c in (False, True)
    }


base.SECTIONS["qag_compile"] = section_qag_compile


# -- 5. DCP with the quantized gather ----------------------------------------------------------

DCP_STEPS = 2


def _dcp_model(recipe: Any, seed: int) -> nn.Module:
    model = fc.convert(AccPair(), recipe=recipe, quantized_all_gather=True, keep_head=False)
    if seed:  # other values, so that a load must write them all
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    return _shard(model)


def _train_steps(model: nn.Module, recipe: Any, steps: range, rank: int, world: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR * world)
    for step in steps:
        x, y = (rows_of(t, rank) for t in acc_batch(step, 0, world))
        with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            out = model(x)
        ((out - y).square().sum() / y.numel()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _eval(model: nn.Module, recipe: Any, group: Any) -> torch.Tensor:
    x = acc_batch(99, 0, 1)[0]
    with fc.autocast(recipe=recipe, amax_reduction_group=group), torch.no_grad():
        return model(x)


def dcp_run(name: str, rank: int, world: int) -> dict[str, Any]:
    """The pair with the quantized gather, trained ``DCP_STEPS`` steps and saved with DCP;
    loaded into a fresh such model (other values): its parameters, delayed states,
    forward, and parameters after one more step on both models; rank 0: loaded into one
    plain unsharded model (converted without a recipe; no process group)."""
    import os  # noqa: PLC0415

    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from _dist_workers import layer_states  # noqa: PLC0415

    import fastcast.dcp  # noqa: PLC0415

    path = os.path.join(os.environ["FASTCAST_TEST_OUT"], f"dcp_{name}")
    recipe = RECIPES[name]()
    group = dist.group.WORLD
    model = _dcp_model(recipe, 0)
    _train_steps(model, recipe, range(DCP_STEPS), rank, world)
    sd = model.state_dict()
    out: dict[str, Any] = {
        "types": sorted({type(getattr(v, "_local_tensor", v)).__name__ for v in sd.values()}),
        "params": _plain(full_params(model)),
        "states": layer_states(model) if name == "delayed" else [],
    }
    dcp.save({"model": sd}, checkpoint_id=path)
    out["forward"] = _eval(model, recipe, group)
    fresh = _dcp_model(recipe, 1)
    sd = {"model": fresh.state_dict()}
    fastcast.dcp.load(sd, checkpoint_id=path)
    fresh.load_state_dict(sd["model"])
    out["loaded_params"] = _plain(full_params(fresh))
    out["loaded_states"] = layer_states(fresh) if name == "delayed" else []
    out["loaded_forward"] = _eval(fresh, recipe, group)
    for m in (model, fresh):
        _train_steps(m, recipe, range(DCP_STEPS, DCP_STEPS + 1), rank, world)
    out["next_params"] = _plain(full_params(model))
    out["loaded_next_params"] = _plain(full_params(fresh))
    dist.barrier()
    if rank == 0:
        single = fc.convert(AccPair())
        sd = {"model": single.state_dict()}
        fastcast.dcp.load(sd, checkpoint_id=path, no_dist=True)
        single.load_state_dict(sd["model"])
        out["single_params"] = full_params(single)
        out["single_states"] = layer_states(single) if name == "delayed" else []
        out["single_forward"] = _eval(single, recipe, None)
    dist.barrier()
    return out
