"""Worker processes for ``test_distributed.py`` (two ranks, gloo, CPU).

Spawned processes import their target by name, so everything they run lives here, at
module level. ``entry`` initialises the process group, runs one *section* (a function
below that returns a dict of plain tensors, numbers and strings), saves the result to
``<out_dir>/<section>_rank<r>.pt`` and, on failure, the traceback to
``<out_dir>/error_rank<r>.txt`` so the test can show it.

The sections do several checks per spawn because starting two interpreters that import
torch costs seconds on a small machine.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fastcast as fc

# A collective that never completes raises after this long, so a deadlocked rank exits
# (with a traceback) well before the test's own hard timeout kills it.
PG_TIMEOUT = datetime.timedelta(seconds=45)
WIDTH = 64
LOCAL_BATCH = 32


def entry(section: str, rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks share two cores with everything else
    if sys.platform == "linux":  # both ranks are local: talk over loopback, skip DNS
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=PG_TIMEOUT,
        )
        os.environ["FASTCAST_TEST_OUT"] = out_dir  # a directory the ranks share
        result = SECTIONS[section](rank, world)
        torch.save(result, os.path.join(out_dir, f"{section}_rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error_rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


# -- helpers ------------------------------------------------------------------------------


def isolated(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a new thread, so with a delayed-scaling registry of its own.

    The registry is per thread and, when an outermost autocast exits, updates every slab
    that has a reduction group, whatever key it belongs to (see
    ``test_unrelated_autocast_touches_grouped_slabs``); each run below gets a fresh one
    so that earlier runs' slabs neither take part nor change.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # re-raised in the calling thread
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def delayed_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A fc.Linear's delayed-scaling state (history and scales, both directions)."""
    state = fc.read_extra_state(module.get_extra_state())
    return {
        f"{direction}.{name}": state[direction][name]
        for direction in ("forward", "backward")
        for name in ("amax_history", "scale")
    }


def fc_linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, fc.Linear)]


def make_mlp(depth: int = 3, out_features: int = 32) -> nn.Sequential:
    """``depth`` fc.Linear layers of width 64 with ReLUs between, identical on every rank."""
    torch.manual_seed(1234)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(WIDTH, out_features if i == depth - 1 else WIDTH))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return fc.convert(nn.Sequential(*layers))


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch ``[world * 32, 64]`` and targets ``[world * 32, 32]``.

    Rank r trains on rows ``r*32:(r+1)*32``, scaled by ``4**r``, so every rank's amaxes
    differ; the single-process reference trains on all rows at once.
    """
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world * LOCAL_BATCH, WIDTH, generator=g)
    scale = torch.repeat_interleave(4.0 ** torch.arange(world), LOCAL_BATCH).unsqueeze(1)
    y = torch.randn(world * LOCAL_BATCH, 32, generator=g)
    return x * scale, y


def local_rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def loss_fn(out: torch.Tensor, y: torch.Tensor, global_rows: int) -> torch.Tensor:
    # Sum over the rows at hand divided by the *global* row count: the gradient reaching
    # each fc.Linear on a rank is then, row for row, the one a single process computes
    # on the whole batch, so gradient amaxes (and the scales made from them) agree.
    return (out.float() - y).square().sum() / global_rows


def train(
    model: nn.Module,
    recipe: Any,
    group: Any,
    rank: int | None,
    world: int,
    steps: int,
    lr: float,
) -> dict[str, Any]:
    """SGD for ``steps`` steps on this rank's rows (``rank=None``: all rows, one process)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, world)
        if rank is not None:
            x, y = local_rows(x, rank), local_rows(y, rank)
        with fc.autocast(recipe=recipe, amax_reduction_group=group):
            loss = loss_fn(model(x), y, world * LOCAL_BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"losses": torch.stack(losses)}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name, gathered to full tensors when sharded (FSDP2 DTensors)."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def layer_states(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    return [delayed_state(m) for m in fc_linears(model)]


RECIPES = {
    "delayed": lambda: fc.DelayedScaling(amax_history_len=16),
    "current": lambda: fc.Float8CurrentScaling(),
}
STEPS = 5
LR = 0.05


def training_run(wrap: Any, recipe_name: str, group: Any, rank: int | None, world: int):
    """Build the MLP, wrap it (DDP, FSDP2 or nothing), train it; what the tests compare."""
    model = make_mlp()
    init = full_params(model)
    wrapped = wrap(model)
    # DDP and FSDP2 average gradients over ranks; ``loss_fn`` makes each rank's gradient
    # its share of the global one, so the distributed runs step with ``lr * world``.
    lr = LR if rank is None else LR * world
    res = train(wrapped, RECIPES[recipe_name](), group, rank, world, STEPS, lr)
    res["init"] = init
    res["params"] = full_params(model)
    res["states"] = layer_states(model) if recipe_name == "delayed" else []
    return res


def reference_runs(world: int) -> dict[str, Any]:
    """Single-process training on the concatenated batch, for every recipe."""
    unwrapped = lambda m: m
    return {name: isolated(training_run, unwrapped, name, None, None, world) for name in RECIPES}


# -- section: delayed-scaling registry over a group (no DDP) ---------------------------------


class CountingAllReduce:
    """Wraps ``torch.distributed.all_reduce`` (looked up by fastcast at call time).

    ``dry=True`` records without communicating (for calls only one rank might make).
    """

    def __init__(self, dry: bool = False) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.dry = dry
        self._orig = dist.all_reduce

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls.append((tensor.numel(), op == dist.ReduceOp.MAX))
        if self.dry:
            return None
        return self._orig(tensor, op=op, group=group, async_op=async_op)

    def __enter__(self) -> CountingAllReduce:
        dist.all_reduce = self
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._orig

    def table(self) -> torch.Tensor:
        return torch.tensor(self.calls, dtype=torch.long).reshape(-1, 2)


def average_gradients(model: nn.Module, world: int) -> None:
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _four_layers(rank: int, world: int) -> dict[str, Any]:
    """Four fc.Linear under DelayedScaling over the group, each rank with its own data
    (scaled by 4**rank); gradients averaged by hand so the weights stay in sync."""
    group = dist.group.WORLD
    model = make_mlp(depth=4, out_features=WIDTH)
    recipe = fc.DelayedScaling(amax_history_len=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    for step in range(4):
        x, y = global_batch(step, world)
        x, y = local_rows(x, rank), local_rows(y, rank)
        with CountingAllReduce() as counter:
            with fc.autocast(recipe=recipe, amax_reduction_group=group):
                out = model(x)
            after_forward = len(counter.calls)
            loss_fn(out[:, :32], y, world * LOCAL_BATCH).backward()
        average_gradients(model, world)  # not counted: this is the user's all_reduce
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(
            {
                "local_input_amax": x.abs().max(),
                "calls": counter.table(),
                "calls_after_forward": after_forward,
                "states": layer_states(model),
            }
        )
    # For contrast: current scaling with a group reduces every input and gradient amax
    # as it quantizes it. Run in a thread of its own (see ``isolated``).
    x = local_rows(global_batch(0, world)[0], rank)
    return {"delayed": steps, "current_calls": isolated(_current_step, model, x, group)}


def _current_step(model: nn.Module, x: torch.Tensor, group: Any) -> torch.Tensor:
    with CountingAllReduce() as counter:
        with fc.autocast(recipe=fc.Float8CurrentScaling(), amax_reduction_group=group):
            out = model(x)
        out.sum().backward()
    return counter.table()


def _unrelated_autocasts(rank: int, world: int) -> dict[str, Any]:
    """After a step under a grouped DelayedScaling key, steps under *other* autocasts
    (no reduction group at all) must neither communicate nor touch that key's state."""
    grouped = make_mlp(depth=2)
    x = local_rows(global_batch(0, world)[0], rank)
    recipe = fc.DelayedScaling(amax_history_len=8)
    with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
        out = grouped(x)
    out.sum().backward()
    before = layer_states(grouped)
    other = make_mlp(depth=2)
    result: dict[str, Any] = {"before": before}
    # Dry counting: if fastcast does reduce here, only this rank would be in the call.
    for name, recipe in (("current", fc.Float8CurrentScaling()), ("delayed", fc.DelayedScaling())):
        with CountingAllReduce(dry=True) as counter:
            with fc.autocast(recipe=recipe):
                out = other(x)
            out.sum().backward()
        result[f"{name}.calls"] = counter.table()
        result[f"{name}.after"] = layer_states(grouped)
    return result


def section_registry(rank: int, world: int) -> dict[str, Any]:
    out = isolated(_four_layers, rank, world)
    # A rank skips a module in one step.
    out["skip_same_key"] = isolated(_skip_run, rank, world, False)
    out["skip_own_key"] = isolated(_skip_run, rank, world, True)
    out["unrelated"] = isolated(_unrelated_autocasts, rank, world)
    return out


class TwoBranches(nn.Module):
    """``a(x) + b(2x)``; ``b`` is left out when ``skip_b``; with ``b_recipe`` it runs
    under a nested autocast of its own (another key, so its own slabs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(99)
        self.a = fc.Linear(WIDTH, WIDTH)
        self.b = fc.Linear(WIDTH, WIDTH)

    def forward(self, x, skip_b=False, b_recipe=None, group=None):
        out = self.a(x)
        if skip_b:
            return out
        if b_recipe is None:
            return out + self.b(2 * x)
        with fc.autocast(recipe=b_recipe, amax_reduction_group=group):
            return out + self.b(2 * x)


def _skip_run(rank: int, world: int, separate_key: bool) -> list[dict[str, Any]]:
    group = dist.group.WORLD
    model = TwoBranches()
    recipe = fc.DelayedScaling(amax_history_len=8)
    b_recipe = fc.DelayedScaling(amax_history_len=8, margin=1) if separate_key else None
    steps = []
    for step in range(4):
        x = local_rows(global_batch(10 + step, world)[0], rank)
        skip = rank == 1 and step == 2  # the third step
        with CountingAllReduce() as counter:
            with fc.autocast(recipe=recipe, amax_reduction_group=group):
                out = model(x, skip_b=skip, b_recipe=b_recipe, group=group)
            out.square().mean().backward()
        model.zero_grad(set_to_none=True)
        steps.append(
            {
                "skipped": skip,
                "b_input_amax": (2 * x).abs().max(),
                "n_calls": len(counter.calls),
                "a": delayed_state(model.a),
                "b": delayed_state(model.b),
            }
        )
    return steps


# -- section: DDP ------------------------------------------------------------------------------


def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    return DistributedDataParallel(model)


def section_ddp(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in RECIPES:
        out[f"{name}.reduced"] = isolated(training_run, _ddp, name, dist.group.WORLD, rank, world)
        # Control: every rank quantizes with its own amaxes.
        out[f"{name}.local"] = isolated(training_run, _ddp, name, None, rank, world)
    if rank == 0:
        out["reference"] = reference_runs(world)
    return out


# -- section: FSDP2 ----------------------------------------------------------------------------


def _fully_shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in fc_linears(model):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _inplace_after_fc_linear(rank: int, world: int) -> dict[str, Any]:
    """fc.Linear followed by ``nn.ReLU(inplace=True)`` on ``[batch, seq, features]``
    inputs, under FSDP2: what ``nn.Linear`` allows."""
    model = fc.convert(
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH))
    )
    model = _fully_shard(model)
    x = local_rows(global_batch(0, world)[0], rank).reshape(2, LOCAL_BATCH // 2, WIDTH)
    error = ""
    recipe = fc.Float8CurrentScaling()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                loss = model(x).square().mean()
            loss.backward()
        except RuntimeError as e:
            error = str(e).splitlines()[0]
    views = [str(w.message).splitlines()[0] for w in caught if "view tensor" in str(w.message)]
    return {"error": error, "view_warnings": views}


def section_fsdp2(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in RECIPES:
        out[name] = isolated(training_run, _fully_shard, name, dist.group.WORLD, rank, world)
    out["sharded_shape"] = isolated(_local_shard_shape)
    out["inplace"] = isolated(_inplace_after_fc_linear, rank, world)
    if rank == 0:
        out["reference"] = reference_runs(world)
    return out


def _local_shard_shape() -> torch.Tensor:
    model = _fully_shard(make_mlp())
    return torch.tensor([list(m.weight.to_local().shape) for m in fc_linears(model)])


SECTIONS = {
    "registry": section_registry,
    "ddp": section_ddp,
    "fsdp2": section_fsdp2,
}


# -- section: tensor parallelism (parallelize_module) --------------------------------------

# Every recipe, as the tensor-parallel tests name them. Sizes: the hidden layer (256) splits
# into shards of 128 on two ranks, a multiple of every recipe's block along it.
TP_RECIPES = {
    "delayed": lambda: fc.DelayedScaling(amax_history_len=4),
    "current": lambda: fc.Float8CurrentScaling(),
    "rowwise": lambda: fc.Float8RowwiseScaling(),
    "rowwise_gw_hp": lambda: fc.Float8RowwiseScaling(wgrad_high_precision=True),
    "block": lambda: fc.Float8BlockScaling(),
    "mxfp8": lambda: fc.MXFP8BlockScaling(),
    # Stochastic rounding off: its random draws are each shard's own (the Hadamard
    # transform stays on: it runs along the tokens, which are not split).
    "nvfp4": lambda: fc.NVFP4BlockScaling(stochastic_rounding=False),
}
TP_IN, TP_HIDDEN, TP_TOKENS, TP_STEPS = 128, 256, 64, 3


def make_tp_mlp(hidden: int = TP_HIDDEN) -> nn.Sequential:
    torch.manual_seed(4321)
    return fc.convert(nn.Sequential(nn.Linear(TP_IN, hidden), nn.ReLU(), nn.Linear(hidden, TP_IN)))


def tp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ``[2, 32, 128]`` batch on every rank (tensor parallelism replicates it)."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(2, TP_TOKENS // 2, TP_IN, generator=g)
    return x, torch.randn(2, TP_TOKENS // 2, TP_IN, generator=g)


def _tp(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def tp_training(recipe_name: str, parallel: bool, group: Any) -> dict[str, Any]:
    """3 SGD steps of the MLP, tensor parallel or not: losses, first-step gradients, the
    first layer's output before training and the parameters after."""
    model = make_tp_mlp()
    if parallel:
        model = _tp(model)
    recipe = TP_RECIPES[recipe_name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x0 = tp_batch(0)[0]
    with fc.autocast(recipe=recipe, amax_reduction_group=group), torch.no_grad():
        first_layer = _full(model[0](x0))
    losses, grads = [], {}
    for step in range(TP_STEPS):
        x, y = tp_batch(step)
        with fc.autocast(recipe=recipe, amax_reduction_group=group):
            out = model(x)
        loss = (out - y).square().mean()
        loss.backward()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    res = {
        "losses": torch.stack(losses),
        "grads": grads,
        "first_layer": first_layer,
        "params": {n: _full(p) for n, p in model.named_parameters()},
    }
    if recipe_name == "delayed":
        res["states"] = layer_states(model)
    return res


def _tp_errors() -> dict[str, str]:
    """What a user gets for a tensor-parallel setup fastcast refuses."""
    x = tp_batch(0)[0]
    out = {}
    cases = {
        "delayed_without_group": (make_tp_mlp(), fc.DelayedScaling()),
        "block_misaligned": (make_tp_mlp(hidden=192), fc.Float8BlockScaling()),
    }
    for name, (model, recipe) in cases.items():
        model = _tp(model)
        try:
            with fc.autocast(recipe=recipe):
                model(x)
            out[name] = ""
        except ValueError as e:
            out[name] = str(e)
    return out


LLAMA_RECIPES = ("delayed", "current", "mxfp8", "nvfp4")
LLAMA_INTERMEDIATE, LLAMA_LR = 256, 0.1


def llama_training(
    recipe_name: str,
    parallel: bool,
    group: Any,
    start: list[dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """A one-layer Hugging Face Llama built from a config, attention and MLP projections
    split Megatron-style (q/k/v, gate/up colwise; o, down rowwise), 3 SGD steps: each
    step's loss, gradients and the parameters after it.

    ``start`` (the one-process reference): step ``s > 0`` starts from ``start[s - 1]``,
    the tensor-parallel run's parameters after step ``s - 1``, so that each step is
    compared from the same parameters (SGD keeps no other state) and a code that FP32
    rounding flipped in one step does not carry into the next."""
    import transformers  # noqa: PLC0415

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=LLAMA_INTERMEDIATE,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    torch.manual_seed(77)
    model = fc.convert(transformers.LlamaForCausalLM(config))
    if parallel:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.tensor.parallel import (  # noqa: PLC0415
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        col, row = ColwiseParallel(), RowwiseParallel()
        plan = {f"self_attn.{p}_proj": col for p in "qkv"} | {"self_attn.o_proj": row}
        plan |= {"mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row}
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
    recipe = TP_RECIPES[recipe_name]()
    opt = torch.optim.SGD(model.parameters(), lr=LLAMA_LR)
    losses, grads, params = [], [], []
    for step in range(TP_STEPS):
        if start is not None and step > 0:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(start[step - 1][n])
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        with fc.autocast(recipe=recipe, amax_reduction_group=group):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        params.append({n: _full(p) for n, p in model.named_parameters()})
    return {"losses": torch.stack(losses), "grads": grads, "params": params}


def sequence_parallel_training(recipe_name: str, rank: int, world: int) -> dict[str, Any]:
    """The MLP with sequence parallelism: each rank holds half the sequence; the colwise
    layer all-gathers it (``input_layouts=Shard(1)``), the rowwise one hands back the
    rank's half (``output_layouts=Shard(1)``). Loss: each rank's rows over the global
    count, so the sum over ranks is the single process's mean."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(
        make_tp_mlp(),
        mesh,
        {
            "0": ColwiseParallel(input_layouts=Shard(1)),
            "2": RowwiseParallel(output_layouts=Shard(1)),
        },
    )
    recipe = TP_RECIPES[recipe_name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    seq = TP_TOKENS // 2 // world
    for step in range(TP_STEPS):
        x, y = tp_batch(step)
        rows = slice(rank * seq, (rank + 1) * seq)
        with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            out = model(x[:, rows])
        loss = (out - y[:, rows]).square().sum() / y.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "params": {n: _full(p) for n, p in model.named_parameters()},
    }


def section_tp(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, name in enumerate(TP_RECIPES):
        out[name] = isolated(tp_training, name, True, dist.group.WORLD)
        if i % world == rank:  # the single-process references, shared out over the ranks
            out[f"{name}.reference"] = isolated(tp_training, name, False, None)
    # Current scaling without a group: the layer reduces over the tensor-parallel group.
    out["current.no_group"] = isolated(tp_training, "current", True, None)
    out["errors"] = isolated(_tp_errors)
    for name in ("current", "mxfp8"):
        out[f"sp.{name}"] = isolated(sequence_parallel_training, name, rank, world)
    return out


def section_tp_llama(rank: int, world: int) -> dict[str, Any]:
    """A tiny Hugging Face Llama under tensor parallelism (``make test-slow``)."""
    out: dict[str, Any] = {}
    for i, name in enumerate(LLAMA_RECIPES):
        out[f"llama.{name}"] = isolated(llama_training, name, True, dist.group.WORLD)
        if i % world == rank:  # from each step's parameters (every rank holds them all)
            start = out[f"llama.{name}"]["params"]
            out[f"llama.{name}.reference"] = isolated(llama_training, name, False, None, start)
    return out


def section_tp_dcp(rank: int, world: int) -> dict[str, Any]:
    return {name: isolated(_tp_dcp, name, rank) for name in ("delayed", "current", "mxfp8")}


def _tp_dcp(recipe_name: str, rank: int) -> dict[str, Any]:
    """Train the tensor-parallel MLP 2 steps, save it with DCP on both ranks; load it into
    a fresh tensor-parallel model (both ranks) and, resharded, into one unsharded model
    on rank 0 (no process group): forwards, parameters and delayed states afterwards."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    import fastcast.dcp  # noqa: PLC0415

    path = os.path.join(os.environ["FASTCAST_TEST_OUT"], f"dcp_{recipe_name}")
    recipe = TP_RECIPES[recipe_name]()
    group = dist.group.WORLD
    model = _tp(make_tp_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = tp_batch(step)
        with fc.autocast(recipe=recipe, amax_reduction_group=group):
            (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    x = tp_batch(7)[0]

    def forward(m: nn.Module, g: Any) -> torch.Tensor:
        with fc.autocast(recipe=recipe, amax_reduction_group=g), torch.no_grad():
            return _full(m(x))

    # Saved before the forward: a delayed-scaling forward updates the histories it saves.
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    out: dict[str, Any] = {"saved_params": {n: _full(p) for n, p in model.named_parameters()}}
    out["saved_states"] = layer_states(model) if recipe_name == "delayed" else []
    out["saved"] = forward(model, group)
    # Back into a fresh tensor-parallel model (converted without a recipe: the extra
    # states are the stateless header until loaded; fastcast.dcp.LoadPlanner sizes them).
    fresh = _tp(make_tp_mlp())
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=path, planner=fastcast.dcp.LoadPlanner())
    fresh.load_state_dict(sd["model"])
    out["tp_loaded"] = forward(fresh, group)
    dist.barrier()
    if rank == 0:  # resharded: one process, plain tensors
        single = make_tp_mlp()
        sd = {"model": single.state_dict()}
        dcp.load(sd, checkpoint_id=path, planner=fastcast.dcp.LoadPlanner(), no_dist=True)
        single.load_state_dict(sd["model"])
        out["single_params"] = {n: _full(p) for n, p in single.named_parameters()}
        out["single_states"] = layer_states(single) if recipe_name == "delayed" else []
        out["single"] = forward(single, None)
    dist.barrier()
    return out


SECTIONS["tp"] = section_tp
SECTIONS["tp_llama"] = section_tp_llama
SECTIONS["tp_dcp"] = section_tp_dcp


# -- section: FSDP2 with the quantized (FP8) all-gather ----------------------------------------

FP8AG_STEPS = 3
LEAK_STEPS = 20
LIVE_AFTER = (1, 10, 20)  # steps after which live tensors are counted


class CountingAllGather:
    """Wraps ``dist.all_gather_single`` (FSDP2's all-gather, looked up at call time): the
    bytes each call sends, by phase (``phase`` is set by the training loop)."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {"forward": 0, "backward": 0, "eval": 0}
        self.phase = "forward"
        self._orig = dist.all_gather_single

    def __call__(self, output, input, group=None, async_op=False):  # noqa: A002
        self.sent[self.phase] += input.numel() * input.element_size()
        return self._orig(output, input, group=group, async_op=async_op)

    def __enter__(self) -> CountingAllGather:
        dist.all_gather_single = self
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single = self._orig


def _fp8ag_model(recipe_name: str, quantized: bool, sharded: bool) -> nn.Module:
    # (A recipe object of its own: the autocast's is another, equal one.)
    recipe = RECIPES[recipe_name]()
    model = fc.convert(make_mlp(), recipe=recipe, quantized_all_gather=quantized, keep_head=False)
    return _fully_shard(model) if sharded else model


def _live_storage(held: Any) -> tuple[int, int]:
    """(live tensors, bytes of their distinct storages) of this process after a gc, but
    for the tensors in ``held`` (what the test keeps for its comparisons). The least of
    two samples: a tensor that a background thread (gloo's) holds for a moment is not
    counted, a tensor that stays alive is."""
    import gc  # noqa: PLC0415

    from torch.utils._pytree import tree_leaves  # noqa: PLC0415

    held = [t for t in tree_leaves(held) if isinstance(t, torch.Tensor)]
    skip = {id(t) for t in held} | {id(t._base) for t in held if t._base is not None}
    samples = []
    for _ in range(2):
        gc.collect()
        count, storages = 0, {}
        for obj in gc.get_objects():
            if (type(obj) is torch.Tensor or type(obj) is nn.Parameter) and id(obj) not in skip:
                count += 1
                storage = obj.untyped_storage()
                storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
        samples.append((count, sum(storages.values())))
    return min(samples)


def fp8ag_run(
    recipe_name: str, quantized: bool, rank: int | None, world: int, precompute: bool = False
) -> dict[str, Any]:
    """SGD for ``LEAK_STEPS`` steps (``rank=None``: one process, whole
    batch): the first forward's output, the first ``FP8AG_STEPS`` losses and gradients
    (full tensors) and the parameters after them, the all-gather bytes by phase, the
    all-reduces per step, and the live tensors/storage after the first and the last step."""
    from fastcast.distributed.fsdp import GatheredFloat8Weight, precompute_float8_scales  # noqa: PLC0415

    recipe = RECIPES[recipe_name]()
    sharded = rank is not None
    model = _fp8ag_model(recipe_name, quantized, sharded)
    group = dist.group.WORLD if sharded else None
    opt = torch.optim.SGD(model.parameters(), lr=LR * world if sharded else LR)
    res: dict[str, Any] = {"losses": [], "grads": [], "reductions": []}
    direct = [0]  # GEMM operands taken from gathered FP8 weights as they are
    as_operand = GatheredFloat8Weight.quantized

    def counted(self: Any, columnwise: bool) -> Any:
        direct[0] += 1
        return as_operand(self, columnwise)

    GatheredFloat8Weight.quantized = counted
    with CountingAllGather() as gathers, CountingAllReduce() as reduces:
        for step in range(LEAK_STEPS):
            x, y = global_batch(step % 5, world)
            if sharded:
                x, y = local_rows(x, rank), local_rows(y, rank)
            gathers.phase = "forward" if step == 0 else "later"
            gathers.sent.setdefault("later", 0)
            before = len(reduces.calls)
            with fc.autocast(recipe=recipe, amax_reduction_group=group):
                out = model(x)
                loss = loss_fn(out, y, world * LOCAL_BATCH)
            if step == 0:
                res["out0"] = out.detach().clone()
                gathers.phase = "backward"
            loss.backward()
            if step < FP8AG_STEPS:
                res["grads"].append(
                    {
                        n: (p.grad.full_tensor() if sharded else p.grad).clone()
                        for n, p in model.named_parameters()
                    }
                )
            opt.step()
            opt.zero_grad(set_to_none=True)
            if precompute:
                precompute_float8_scales(model)
            res["reductions"].append(torch.tensor(reduces.calls[before:]).reshape(-1, 2))
            res["losses"].append(loss.detach())
            if step == FP8AG_STEPS - 1:
                res["params"] = full_params(model)
            if sharded and step + 1 in LIVE_AFTER:
                res.setdefault("live", []).append(torch.tensor(_live_storage(res)))
        res["params_last"] = full_params(model)
        # Evaluation outside autocast, on a fixed input.
        gathers.phase = "eval"
        with torch.no_grad():
            res["eval"] = model(global_batch(7, 1)[0][:8]).detach()
    GatheredFloat8Weight.quantized = as_operand
    res["direct"] = direct[0]
    res["losses"] = torch.stack(res["losses"][:FP8AG_STEPS])
    res["bytes"] = dict(gathers.sent)
    res["weight_types"] = [
        type(getattr(m.weight, "_local_tensor", m.weight)).__name__ for m in fc_linears(model)
    ]
    return res


def _fp8ag_refusals() -> dict[str, str]:
    """fc.convert's errors for quantized_all_gather it cannot do, and whether the model
    was left as it was."""
    out = {}
    custom = fc.CustomRecipe(qfactory=lambda role: fc.Float8CurrentScaling())
    for name, recipe in (("custom", custom), ("none", None)):
        model = nn.Sequential(nn.Linear(WIDTH, WIDTH))
        try:
            fc.convert(model, recipe=recipe, quantized_all_gather=True, keep_head=False)
            out[name] = ""
        except (ValueError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        out[f"{name}.unchanged"] = str(type(model[0]) is nn.Linear)
    return out


def section_fsdp_fp8(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"refusals": _fp8ag_refusals()}
    for name in RECIPES:
        out[name] = {
            "fp8": isolated(fp8ag_run, name, True, rank, world),
            "hp": isolated(fp8ag_run, name, False, rank, world),
        }
        if rank == 0:
            out[name]["reference"] = isolated(fp8ag_run, name, False, None, world)
    out["current"]["precompute"] = isolated(fp8ag_run, "current", True, rank, world, True)
    out["delayed"]["no_group"] = isolated(_delayed_without_group, rank, world)
    out["dcp"] = isolated(_fp8ag_dcp, rank, world)
    return out


def section_fsdp_fp8_models(rank: int, world: int) -> dict[str, Any]:
    """The FP8 all-gather's longer runs (``make test-slow``): without re-gather, under
    activation checkpointing, and a tiny Hugging Face Llama."""
    out: dict[str, Any] = {}
    for name in RECIPES:
        out[name] = {
            "variants": {
                v: isolated(_fp8ag_variant, name, v, rank, world)
                for v in ("plain", "fp8_no_reshard", "fp8_checkpointed")
            },
            "llama": {"fp8": isolated(fp8ag_llama, name, True, rank, world)},
        }
        if rank == 0:
            out[name]["llama"]["reference"] = isolated(fp8ag_llama, name, False, None, world)
    return out


def sharded_llama(
    recipe: fc.Recipe, quantized: bool, seed: int, hidden: int, mlp: int, world: int | None
) -> nn.Module:
    """A converted one-layer Hugging Face Llama built from a config; with ``world``, every
    fc.Linear, the decoder layer and the model ``fully_shard``-ed over the world."""
    import transformers  # noqa: PLC0415

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    model = fc.convert(
        transformers.LlamaForCausalLM(config), recipe=recipe, quantized_all_gather=quantized
    )
    if world is not None:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        mesh = init_device_mesh("cpu", (world,))
        for m in fc_linears(model):
            fully_shard(m, mesh=mesh)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def fp8ag_llama(recipe_name: str, quantized: bool, rank: int | None, world: int) -> dict[str, Any]:
    """A one-layer Hugging Face Llama from a config, every fc.Linear (lm_head included)
    and the decoder layer ``fully_shard``-ed, 3 SGD steps; each rank its own sequences
    (``rank=None``: one process, all of them)."""
    recipe = RECIPES[recipe_name]()
    model = sharded_llama(recipe, quantized, 77, 64, 128, None if rank is None else world)
    group = None if rank is None else dist.group.WORLD
    # As loss_fn does: each rank's loss is its share of the global one (a sum over its
    # tokens over the global count), so gradients (and their amaxes) agree row for row
    # with one process; FSDP2 averages over the ranks, hence lr * world.
    opt = torch.optim.SGD(model.parameters(), lr=0.1 if rank is None else 0.1 * world)
    losses = []
    for step in range(FP8AG_STEPS):
        ids = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(step))
        if rank is not None:
            ids = ids[2 * rank : 2 * rank + 2]
        with fc.autocast(recipe=recipe, amax_reduction_group=group):
            # (labels are shifted by one inside: 15 predicted tokens per sequence)
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=2 * world * 15).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": full_params(model)}


class _CheckpointedPair(nn.Module):
    """Two fc.Linear with a ReLU between, optionally under activation checkpointing."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.checkpointed = checkpointed

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

            return checkpoint(self._run, x, use_reentrant=False)
        return self._run(x)


def _fp8ag_variant(recipe_name: str, variant: str, rank: int, world: int) -> dict[str, Any]:
    """Two pairs of fc.Linear, each pair ``fully_shard``-ed, 3 SGD steps: ``plain`` (the
    high-precision gather), ``fp8_no_reshard`` (FP8 gather, ``reshard_after_forward=False``:
    no re-gather in backward), ``fp8_checkpointed`` (FP8 gather, each pair under
    activation checkpointing: the recomputation uses the re-gathered weight)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    recipe = {**RECIPES, **QAG_RECIPES}[recipe_name]()
    torch.manual_seed(5)
    checkpointed = variant == "fp8_checkpointed"
    model = fc.convert(
        nn.Sequential(_CheckpointedPair(checkpointed), _CheckpointedPair(checkpointed)),
        recipe=recipe,
        quantized_all_gather=variant != "plain",
    )
    mesh = init_device_mesh("cpu", (world,))
    for pair in model:
        fully_shard(pair, mesh=mesh, reshard_after_forward=variant != "fp8_no_reshard")
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(FP8AG_STEPS):
        x, y = (local_rows(t, rank) for t in global_batch(step, world))
        with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss = (model(x)[:, :32] - y).square().sum() / (world * LOCAL_BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": full_params(model)}


def _fp8ag_dcp(rank: int, world: int) -> dict[str, Any]:
    """An FSDP2 model with the FP8 all-gather, trained 2 steps and saved with DCP: the
    state dict's local shards (plain tensors), then loads into a fresh such model and,
    resharded, into one plain unsharded model on rank 0; forwards and parameters."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    import fastcast.dcp  # noqa: PLC0415

    path = os.path.join(os.environ["FASTCAST_TEST_OUT"], "dcp_fp8ag")
    recipe = RECIPES["current"]()
    model = _fp8ag_model("current", True, True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        x, y = (local_rows(t, rank) for t in global_batch(step, world))
        with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss_fn(model(x), y, world * LOCAL_BATCH).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    x = global_batch(7, 1)[0][:8]

    def forward(m: nn.Module) -> torch.Tensor:
        with fc.autocast(recipe=recipe), torch.no_grad():
            return m(x)

    sd = model.state_dict()
    out: dict[str, Any] = {
        "local_types": sorted({type(getattr(v, "_local_tensor", v)).__name__ for v in sd.values()}),
        "saved_params": full_params(model),
        "saved": forward(model),
    }
    dcp.save({"model": sd}, checkpoint_id=path)
    torch.manual_seed(99)
    fresh = _fully_shard(
        fc.convert(
            nn.Sequential(*(m for m in make_mlp())), recipe=recipe, quantized_all_gather=True
        )
    )
    for p in fresh.parameters():  # other values, so that the load must write them all
        p.data.mul_(0.5)
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=path, planner=fastcast.dcp.LoadPlanner())
    fresh.load_state_dict(sd["model"])
    out["loaded_types"] = [type(m.weight._local_tensor).__name__ for m in fc_linears(fresh)]
    out["loaded"] = forward(fresh)
    dist.barrier()
    if rank == 0:
        single = make_mlp()
        sd = {"model": single.state_dict()}
        dcp.load(sd, checkpoint_id=path, planner=fastcast.dcp.LoadPlanner(), no_dist=True)
        single.load_state_dict(sd["model"])
        out["single_params"] = full_params(single)
    dist.barrier()
    return out


def _delayed_without_group(rank: int, world: int) -> str:
    """DelayedScaling's quantized gather under an autocast without a group: the error."""
    recipe = RECIPES["delayed"]()
    model = _fp8ag_model("delayed", True, True)
    x = local_rows(global_batch(0, world)[0], rank)
    try:
        with fc.autocast(recipe=recipe):
            model(x)
    except ValueError as e:
        return str(e)
    return ""


SECTIONS["fsdp_fp8"] = section_fsdp_fp8
SECTIONS["fsdp_fp8_models"] = section_fsdp_fp8_models


def _fp8ag_compiled(recipe_name: str, compiled: bool, rank: int, world: int) -> dict[str, Any]:
    """The FSDP2 MLP with the FP8 all-gather, eager or ``torch.compile``-d, 2 SGD steps:
    outputs, gradients, and how many GEMMs took a gathered FP8 weight as it is."""
    from fastcast.distributed.fsdp import GatheredFloat8Weight  # noqa: PLC0415

    recipe = RECIPES[recipe_name]()
    model = _fp8ag_model(recipe_name, True, True)
    run = torch.compile(model) if compiled else model  # (compiled: 0 or 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    direct = [0]
    as_operand = GatheredFloat8Weight.quantized

    def counted(self: Any, columnwise: bool) -> Any:
        direct[0] += 1
        return as_operand(self, columnwise)

    GatheredFloat8Weight.quantized = counted
    res: dict[str, Any] = {"outs": [], "grads": []}
    try:
        for step in range(2):
            x, y = (local_rows(t, rank) for t in global_batch(step, world))
            with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                out = run(x)
            loss_fn(out, y, world * LOCAL_BATCH).backward()
            res["outs"].append(out.detach())
            res["grads"].append([p.grad.full_tensor() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        GatheredFloat8Weight.quantized = as_operand
    res["direct"] = direct[0]
    return res


def section_fsdp_fp8_compile(rank: int, world: int) -> dict[str, Any]:
    return {"current": {c: isolated(_fp8ag_compiled, "current", c, rank, world) for c in (0, 1)}}


SECTIONS["fsdp_fp8_compile"] = section_fsdp_fp8_compile


# -- section: FSDP2's quantized all-gather for the block-scaled recipes --------------------------

# Stochastic rounding off: its draws are each rank's own (the Hadamard transform stays on:
# it runs along the tokens, and each rank's tokens are one micro-batch of the reference).
QAG_RECIPES = {
    "rowwise": lambda: fc.Float8RowwiseScaling(),
    "rowwise_gw_hp": lambda: fc.Float8RowwiseScaling(wgrad_high_precision=True),
    "block": lambda: fc.Float8BlockScaling(),
    "mxfp8": lambda: fc.MXFP8BlockScaling(),
    "nvfp4": lambda: fc.NVFP4BlockScaling(stochastic_rounding=False),
}
# in -> hidden -> hidden -> out: 256 rows split into shards of 128 (a 128x128 tile); the
# last layer's 64 rows into shards of 32 (MXFP8's and NVFP4's blocks, not a 128 tile).
QAG_SIZES = (128, 256, 256, 64)
QAG_LEAK_STEPS = 8
QAG_LIVE_AFTER = (1, 4, 8)


def make_qag_mlp() -> nn.Sequential:
    torch.manual_seed(2468)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(QAG_SIZES, QAG_SIZES[1:])):
        layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(QAG_SIZES) - 2 else [])
    return nn.Sequential(*layers)


def qag_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``world`` micro-batches of 32 tokens; micro-batch r scaled by 4**r."""
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(world * LOCAL_BATCH, QAG_SIZES[0], generator=g)
    scale = torch.repeat_interleave(4.0 ** torch.arange(world), LOCAL_BATCH).unsqueeze(1)
    return x * scale, torch.randn(world * LOCAL_BATCH, QAG_SIZES[-1], generator=g)


def qag_run(
    recipe_name: str, quantized: bool, rank: int | None, world: int, precompute: bool = False
) -> dict[str, Any]:
    """SGD on the MLP for ``QAG_LEAK_STEPS`` steps. Sharded (``rank``): FSDP2 over the
    ranks, each its micro-batch. One process (``rank=None``): every micro-batch in rank
    order, gradients accumulated (what data parallelism computes, the quantization of
    each micro-batch's activations included). The first ``FP8AG_STEPS`` losses (per
    micro-batch) and gradients, the parameters after them, the gathered bytes of the
    first step by phase, the live tensors after ``QAG_LIVE_AFTER`` steps, warnings."""
    from fastcast.distributed.fsdp import (  # noqa: PLC0415
        GatheredQuantizedWeight,
        precompute_float8_scales,
    )

    recipe = QAG_RECIPES[recipe_name]()
    sharded = rank is not None
    model = fc.convert(
        make_qag_mlp(), recipe=recipe, quantized_all_gather=quantized, keep_head=False
    )
    if sharded:
        model = _fully_shard(model)
    # FSDP2 averages the ranks' gradients, one process sums them: lr * world.
    opt = torch.optim.SGD(model.parameters(), lr=LR * world if sharded else LR)
    res: dict[str, Any] = {"losses": [], "grads": [], "reductions": []}
    direct = [0]
    as_operand = GatheredQuantizedWeight.quantized

    def counted(self: Any, columnwise: bool) -> Any:
        direct[0] += 1
        return as_operand(self, columnwise)

    GatheredQuantizedWeight.quantized = counted
    with (
        warnings.catch_warnings(record=True) as caught,
        CountingAllGather() as gathers,
        CountingAllReduce() as reduces,
    ):
        warnings.simplefilter("always")
        for step in range(QAG_LEAK_STEPS):
            before = len(reduces.calls)
            x, y = qag_batch(step % 3, world)
            gathers.phase = "forward" if step == 0 else "later"
            gathers.sent.setdefault("later", 0)
            losses = []
            for r in [rank] if sharded else range(world):
                with fc.autocast(recipe=recipe):
                    loss = loss_fn(model(local_rows(x, r)), local_rows(y, r), world * LOCAL_BATCH)
                if step == 0:
                    gathers.phase = "backward"
                loss.backward()
                losses.append(loss.detach())
            if step < FP8AG_STEPS:
                res["losses"].append(torch.stack(losses))
                res["grads"].append(
                    {
                        n: (p.grad.full_tensor() if sharded else p.grad).clone()
                        for n, p in model.named_parameters()
                    }
                )
            opt.step()
            opt.zero_grad(set_to_none=True)
            if precompute:
                precompute_float8_scales(model)
            res["reductions"].append(torch.tensor(reduces.calls[before:]).reshape(-1, 2))
            if step == FP8AG_STEPS - 1:
                res["params"] = _plain(full_params(model))
            if sharded and quantized and step + 1 in QAG_LIVE_AFTER:
                res.setdefault("live", []).append(torch.tensor(_live_storage(res)))
    GatheredQuantizedWeight.quantized = as_operand
    res["direct"] = direct[0]
    res["losses"] = torch.stack(res["losses"])
    res["bytes"] = dict(gathers.sent)
    res["warnings"] = [str(w.message) for w in caught if "quantized_all_gather" in str(w.message)]
    res["weight_types"] = [
        type(getattr(m.weight, "_local_tensor", m.weight)).__name__ for m in fc_linears(model)
    ]
    return res


def qag_llama(recipe_name: str, rank: int | None, world: int) -> dict[str, Any]:
    """A one-layer Hugging Face Llama from a config (hidden 128, MLP 256, every fc.Linear
    and the decoder layer ``fully_shard``-ed), 3 SGD steps, quantized all-gather; one
    process (``rank=None``) runs the ranks' sequences as accumulated micro-batches."""
    recipe = QAG_RECIPES[recipe_name]()
    model = sharded_llama(recipe, True, 78, 128, 256, None if rank is None else world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 if rank is None else 0.1 * world)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the weights gathered in high precision
        for step in range(FP8AG_STEPS):
            generator = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 64, (2 * world, 16), generator=generator)
            step_losses = []
            for r in [rank] if rank is not None else range(world):
                with fc.autocast(recipe=recipe):
                    loss = model(
                        input_ids=ids[2 * r : 2 * r + 2],
                        labels=ids[2 * r : 2 * r + 2],
                        num_items_in_batch=2 * world * 15,
                    ).loss
                loss.backward()
                step_losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(torch.stack(step_losses))
    return {"losses": torch.stack(losses), "params": _plain(full_params(model))}


def _plain(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain tensors of unsharded FSDPFloat8Weight parameters (one process)."""
    return {n: getattr(p, "_tensor", p) for n, p in params.items()}


def qag_bf16(recipe_name: str, quantized: bool, rank: int, world: int) -> dict[str, Any]:
    """The MLP under FSDP2 with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, 3
    SGD steps: losses and parameters."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    recipe = QAG_RECIPES[recipe_name]()
    model = fc.convert(
        make_qag_mlp(), recipe=recipe, quantized_all_gather=quantized, keep_head=False
    )
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in fc_linears(model):
        fully_shard(m, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=LR * world)
    losses = []
    for step in range(FP8AG_STEPS):
        x, y = (local_rows(t, rank) for t in qag_batch(step, world))
        with fc.autocast(recipe=recipe):
            loss = loss_fn(model(x), y, world * LOCAL_BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": full_params(model)}


def section_fsdp_qag(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in QAG_RECIPES:
        out[name] = {
            "q": isolated(qag_run, name, True, rank, world),
            "hp": isolated(qag_run, name, False, rank, world),
        }
        if rank == 0:
            out[name]["reference"] = isolated(qag_run, name, True, None, world)
    for name in ("rowwise", "nvfp4"):
        out[name]["precompute"] = isolated(qag_run, name, True, rank, world, True)
    return out


def section_fsdp_qag_models(rank: int, world: int) -> dict[str, Any]:
    """The block-scaled quantized all-gather's longer runs (``make test-slow``): without
    re-gather, under activation checkpointing, BF16 parameters, a tiny Llama."""
    out: dict[str, Any] = {name: {} for name in ("rowwise", "block", "mxfp8", "nvfp4")}
    for name in ("rowwise", "mxfp8", "nvfp4"):
        out[name]["variants"] = {
            v: isolated(_fp8ag_variant, name, v, rank, world)
            for v in ("plain", "fp8_no_reshard", "fp8_checkpointed")
        }
    for name in ("mxfp8", "nvfp4"):
        out[name]["bf16"] = {
            kind: isolated(qag_bf16, name, kind == "q", rank, world) for kind in ("q", "hp")
        }
    for name in ("rowwise", "block", "mxfp8", "nvfp4"):
        out[name]["llama"] = {"q": isolated(qag_llama, name, rank, world)}
        if rank == 0:
            out[name]["llama"]["reference"] = isolated(qag_llama, name, None, world)
    return out


SECTIONS["fsdp_qag"] = section_fsdp_qag
SECTIONS["fsdp_qag_models"] = section_fsdp_qag_models


# -- several sections in one spawn -------------------------------------------------------------

# The key of a section's result that holds its traceback instead (``section_shared``).
SECTION_ERROR = "__error__"


def section_shared(rank: int, world: int) -> dict[str, Any]:
    """The sections named in ``FASTCAST_TEST_SECTIONS`` (comma-separated), one after the
    other in one spawn: starting two interpreters that import torch costs seconds per
    spawn. Each section starts from the random state of a fresh process (the sections
    seed what they compare, but rank 0's single-process references also draw from the
    generator), and a section that raises leaves its traceback as its result
    (``{SECTION_ERROR: text}``, for its tests to show) while the next ones still run."""
    seed = torch.initial_seed()  # torch's fixed start-up seed: nothing has reseeded yet
    out: dict[str, Any] = {}
    for name in os.environ["FASTCAST_TEST_SECTIONS"].split(","):
        torch.manual_seed(seed)
        try:
            out[name] = SECTIONS[name](rank, world)
        except Exception:  # noqa: BLE001 - reported by the section's tests
            out[name] = {SECTION_ERROR: traceback.format_exc()}
        dist.barrier()
    return out


SECTIONS["shared"] = section_shared
