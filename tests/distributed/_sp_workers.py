"""Worker processes for ``test_sequence_parallel.py``: the FP8 all-gather of a
sequence-sharded input (``fastcast.distributed.QuantizedColwiseParallel``), 2 gloo ranks.

``entry`` is ``_dist_workers.entry`` over this module's section, which it adds to
``_dist_workers.SECTIONS`` (a spawned process imports its target's module). One spawn,
``sp_fp8``: for ``Float8CurrentScaling`` and ``DelayedScaling``, the tensor-parallel MLP
with sequence parallelism trained 3 steps with the FP8 gather and with torch's
``ColwiseParallel`` (the high-precision gather), the bytes each forward all-gathers, and
the single-process run; then one layer over a grid of input shapes, even and uneven.
"""

from __future__ import annotations

from typing import Any

import _dist_workers as base
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _dist_workers import (
    TP_IN,
    TP_RECIPES,
    TP_TOKENS,
    _full,
    isolated,
    layer_states,
    make_tp_mlp,
    tp_batch,
)
from torch import nn

import fastcast as fc

SP_RECIPES = ("current", "delayed")
# The recipes whose row-wise input layout has scales per token (gathered with the codes)
# and whose column-wise layout backward gathers (a second quantized gather).
SP_SCALED = ("rowwise", "mxfp8", "block", "nvfp4")
SP_ALL = SP_RECIPES + SP_SCALED
# Variants on the one-layer grid only: NVFP4 with stochastic rounding (the gradient's
# draws: the same in both gathers, each rank rounding the whole gathered gradient of its
# output features), 128x128 input tiles, and the high-precision weight gradient (which
# keeps the high-precision gather).
SP_VARIANTS = {
    "nvfp4_sr": lambda: fc.NVFP4BlockScaling(),
    "block_x2d": lambda: fc.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
    "rowwise_gw_hp": TP_RECIPES["rowwise_gw_hp"],
}
SP_LAYER_RECIPES = SP_SCALED + tuple(SP_VARIANTS)
SP_STEPS = 3
# The Llama runs: the per-tensor recipes over 16 tokens a sequence, the row-wise and MXFP8
# ones over 64 (each rank's 32 a multiple of MXFP8's block).
SP_LLAMA = SP_RECIPES + ("rowwise", "mxfp8")
SP_LLAMA_SEQ = {"rowwise": 64, "mxfp8": 64}
# Tokens per sequence: each rank's half a multiple of the recipe's block along the tokens
# (MXFP8 32, 1x128 blocks 128; NVFP4's 16 and the others take tp_batch's 32).
SP_SEQ = {"mxfp8": 64, "block": 256}
# Bytes per token of each recipe's row-wise layout (K = TP_IN = 128 features): FP8 codes
# and FP32 row scales / one FP32 scale per 1x128 block / one E8M0 byte per 32; NVFP4 two
# codes a byte and one E4M3 byte per 16. Column-wise (backward's gather, per token): the
# codes and the block scales along the tokens (the row-wise recipe's per-feature scales
# are the same on every rank: not gathered).
SP_ROW_BYTES = {"rowwise": 128 + 4, "mxfp8": 128 + 4, "block": 128 + 4, "nvfp4": 64 + 8}
SP_COLUMN_BYTES = {"rowwise": 128, "mxfp8": 128 + 4, "block": 128 + 4, "nvfp4": 64 + 8}
# Input shapes of the one-layer grid, with the sharded (sequence) dim: even lengths over
# two ranks gather in FP8, odd ones (uneven slices) fall back to the high-precision gather.
SP_SHAPES = {
    "b2_s16": ((2, 16, TP_IN), 1),
    "b2_s9": ((2, 9, TP_IN), 1),
    "b1_s2": ((1, 2, TP_IN), 1),
    "b3_s6": ((3, 6, TP_IN), 1),
    "s12": ((12, TP_IN), 0),
    "s7": ((7, TP_IN), 0),
    "s6_b3": ((6, 3, TP_IN), 0),
}
# The one-layer grid of the scaled recipes: each rank's runs of consecutive tokens (of the
# [R, K] view) are 32, 8, 24 and 128 long; a recipe gathers quantized where they are a
# multiple of its block along the tokens, else in high precision.
SP_SCALED_SHAPES = {
    "b2_s64": ((2, 64, TP_IN), 1),
    "b2_s16": ((2, 16, TP_IN), 1),
    "s6_b8": ((6, 8, TP_IN), 0),
    "s256": ((256, TP_IN), 0),
}


def entry(section: str, rank: int, world: int, init_file: str, out_dir: str) -> None:
    base.entry(section, rank, world, init_file, out_dir)


class GatherBytes:
    """Counts, while ``on``, the bytes each rank sends in all-gathers: fastcast's FP8 one
    (``dist.all_gather_single``, looked up at call time) and DTensor's high-precision one
    (``funcol.all_gather_single``, likewise); while ``on == "backward"`` into
    ``backward_sent`` / ``backward_calls`` instead."""

    def __init__(self) -> None:
        self.sent = {"uint8": 0, "high_precision": 0}
        self.calls = {"uint8": 0, "high_precision": 0}
        self.backward_sent = {"uint8": 0, "high_precision": 0}
        self.backward_calls = {"uint8": 0, "high_precision": 0}
        self.on: bool | str = False
        self._dist = dist.all_gather_single
        self._funcol = funcol.all_gather_single

    def _count(self, kind: str, t: torch.Tensor) -> None:
        if self.on:
            backward = self.on == "backward"
            sent = self.backward_sent if backward else self.sent
            calls = self.backward_calls if backward else self.calls
            sent[kind] += t.numel() * t.element_size()
            calls[kind] += 1

    def __enter__(self) -> GatherBytes:
        def quantized(output, input, group=None, async_op=False):  # noqa: A002
            self._count("uint8" if input.dtype == torch.uint8 else "high_precision", input)
            return self._dist(output, input, group=group, async_op=async_op)

        def high_precision(t, *args, **kwargs):
            self._count("high_precision", t)
            return self._funcol(t, *args, **kwargs)

        dist.all_gather_single = quantized
        funcol.all_gather_single = high_precision
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single = self._dist
        funcol.all_gather_single = self._funcol


def sp_batch(step: int, seq: int = TP_TOKENS // 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``tp_batch`` (``seq`` tokens a sequence) with the second half of every sequence 4x
    larger: the two ranks' slices have different amaxes, so a scale taken from a slice
    alone would be wrong."""
    if seq == TP_TOKENS // 2:
        x, y = tp_batch(step)
    else:
        g = torch.Generator().manual_seed(500 + step)
        x, y = torch.randn(2, seq, TP_IN, generator=g), torch.randn(2, seq, TP_IN, generator=g)
    x = x.clone()
    x[:, x.shape[1] // 2 :] *= 4
    return x, y


def _recipe(name: str) -> Any:
    return (SP_VARIANTS.get(name) or TP_RECIPES[name])()


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _colwise(quantized: bool) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel  # noqa: PLC0415

    from fastcast.distributed.sequence_parallel import QuantizedColwiseParallel  # noqa: PLC0415

    return QuantizedColwiseParallel if quantized else ColwiseParallel


def sp_training(recipe_name: str, quantized: bool, rank: int, world: int) -> dict[str, Any]:
    """The MLP, sequence parallel (each rank half of every sequence), 3 SGD steps: the
    first layer's input gathered in FP8 (``quantized``) or in high precision. The loss
    is each rank's rows over the global count (the ranks' losses sum to the mean)."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module  # noqa: PLC0415

    plan = {
        "0": _colwise(quantized)(input_layouts=Shard(1)),
        "2": RowwiseParallel(output_layouts=Shard(1)),
    }
    model = parallelize_module(make_tp_mlp(), _mesh(), plan)
    recipe = _recipe(recipe_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads, x_grad = [], {}, None
    length = SP_SEQ.get(recipe_name, TP_TOKENS // 2)
    seq = length // world
    rows = slice(rank * seq, (rank + 1) * seq)
    with GatherBytes() as counter:
        for step in range(SP_STEPS):
            x, y = sp_batch(step, length)
            x_local = x[:, rows].clone().requires_grad_()
            counter.on = True  # the forward's gathers
            with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                out = model(x_local)
            counter.on = False
            loss = (out - y[:, rows]).square().sum() / y.numel()
            counter.on = "backward"  # the backward's, apart
            loss.backward()
            counter.on = False
            if step == 0:
                grads = {n: _full(p.grad) for n, p in model.named_parameters()}
                x_grad = x_local.grad.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    res = {
        "losses": torch.stack(losses),
        "grads": grads,
        "x_grad": x_grad,
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "bytes": dict(counter.sent),
        "calls": dict(counter.calls),
        "backward_bytes": dict(counter.backward_sent),
        "backward_calls": dict(counter.backward_calls),
        "local_numel": seq * x.shape[0] * x.shape[2],
        "local_tokens": seq * x.shape[0],
    }
    if recipe_name == "delayed":
        res["states"] = layer_states(model)
    return res


def sp_reference(recipe_name: str) -> dict[str, Any]:
    """The same 3 steps in one process, whole sequences (loss: the mean)."""
    model = make_tp_mlp()
    recipe = _recipe(recipe_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(SP_STEPS):
        x, y = sp_batch(step, SP_SEQ.get(recipe_name, TP_TOKENS // 2))
        with fc.autocast(recipe=recipe):
            out = model(x)
        loss = (out - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    res = {
        "losses": torch.stack(losses),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
    if recipe_name == "delayed":
        res["states"] = layer_states(model)
    return res


def sp_layer(
    recipe_name: str,
    shape: tuple[int, ...],
    dim: int,
    quantized: bool,
    checkpointed: bool = False,
) -> dict[str, Any]:
    """One colwise fc.Linear(128, 64) (the scaled recipes: 256 outputs, a multiple of
    every block over two ranks) given a ``Shard(dim)`` DTensor input of ``shape``
    (torch.chunk's slices, uneven ones included): training and no-grad forwards; the
    training one under activation checkpointing when ``checkpointed``."""
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415

    torch.manual_seed(99)
    layer = fc.convert(
        nn.Sequential(nn.Linear(TP_IN, 256 if recipe_name in SP_LAYER_RECIPES else 64))
    )
    mesh = _mesh()
    layer = parallelize_module(layer, mesh, {"0": _colwise(quantized)(input_layouts=Shard(dim))})
    recipe = _recipe(recipe_name)
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g)
    x_local = x.chunk(mesh.size(), dim=dim)[mesh.get_local_rank()].clone().requires_grad_()
    x_dt = DTensor.from_local(x_local, mesh, [Shard(dim)], shape=x.shape, stride=x.stride())
    attributes = set(vars(x_dt))
    with GatherBytes() as counter:
        counter.on = True
        with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            if checkpointed:  # recomputed in backward, after the autocast
                out = torch.utils.checkpoint.checkpoint(layer, x_dt, use_reentrant=False)
            else:
                out = layer(x_dt)
            with torch.no_grad():
                out_eval = layer(x_dt)
    counter.on = False
    (out.square().sum() * 0.01).backward()
    return {
        "out": out.detach().clone(),
        "out_eval": out_eval.clone(),
        "x_grad": x_local.grad.clone(),
        "grads": {n: p.grad.to_local().clone() for n, p in layer.named_parameters()},
        "fp8_gathers": counter.calls["uint8"],
        "attributes_added": sorted(set(vars(x_dt)) - attributes),
    }


def _sp_llama_plan(model: nn.Module, mesh: Any, quantized: bool) -> nn.Module:
    """torchtitan's sequence-parallel plan for a Hugging Face Llama: embeddings and
    row-parallel outputs ``Shard(1)``, norms ``SequenceParallel``, every column-parallel
    projection (and the head) given the sequence-sharded input itself."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    col = _colwise(quantized)
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    parallelize_module(
        model.model,
        mesh,
        {
            "embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "norm": SequenceParallel(),
        },
    )
    for layer in model.model.layers:
        norms = ("input_layernorm", "post_attention_layernorm")
        plan: dict[str, Any] = {n: SequenceParallel() for n in norms}
        plan |= {f"self_attn.{p}_proj": col(input_layouts=Shard(1)) for p in "qkv"}
        plan |= {f"mlp.{p}_proj": col(input_layouts=Shard(1)) for p in ("gate", "up")}
        plan |= {"self_attn.o_proj": row, "mlp.down_proj": row}
        parallelize_module(layer, mesh, plan)
    # The head's output stays sharded over the vocabulary (gathered after the counting).
    return parallelize_module(model, mesh, {"lm_head": col(input_layouts=Shard(1))})


def sp_llama(recipe_name: str, mode: str) -> dict[str, Any]:
    """A one-layer Hugging Face Llama from a config, 3 SGD steps: sequence parallel with
    the FP8 gather (``mode`` "fp8") or the high-precision one ("hp"), or one process
    ("single"). The loss (next-token cross entropy, as the model's own) is taken from the
    whole logits, gathered after the forward's gathers were counted: each rank's loss is
    the whole batch's."""
    import transformers  # noqa: PLC0415
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    seq = SP_LLAMA_SEQ.get(recipe_name, 16)

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32 if seq <= 32 else seq,
    )
    torch.manual_seed(77)
    model = fc.convert(transformers.LlamaForCausalLM(config))
    if mode != "single":
        model = _sp_llama_plan(model, _mesh(), mode == "fp8")
    recipe = _recipe(recipe_name)
    group = None if mode == "single" else dist.group.WORLD
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with GatherBytes() as counter:
        for step in range(SP_STEPS):
            ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(step))
            counter.on = True
            with fc.autocast(recipe=recipe, amax_reduction_group=group):
                logits = model(input_ids=ids).logits
            counter.on = False
            if mode != "single":  # [2, seq, 32] of the vocabulary on each rank
                logits = DTensor.from_local(logits, _mesh(), [Shard(-1)]).full_tensor()
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
            )
            counter.on = "backward"
            loss.backward()
            counter.on = False
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "bytes": dict(counter.sent),
        "calls": dict(counter.calls),
        "backward_calls": dict(counter.backward_calls),
    }


def section_sp_fp8(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SP_ALL:
        for quantized in (True, False):
            out[f"{name}.{'fp8' if quantized else 'hp'}"] = isolated(
                sp_training, name, quantized, rank, world
            )
        out[f"{name}.reference"] = isolated(sp_reference, name)
    for key, (shape, dim) in SP_SHAPES.items():
        for quantized in (True, False):
            tag = "fp8" if quantized else "hp"
            out[f"layer.{key}.{tag}"] = isolated(sp_layer, "current", shape, dim, quantized)
    for name in SP_LAYER_RECIPES:
        for key, (shape, dim) in SP_SCALED_SHAPES.items():
            for quantized in (True, False):
                tag = "fp8" if quantized else "hp"
                run = isolated(sp_layer, name, shape, dim, quantized)
                out[f"layer.{name}.{key}.{tag}"] = run
    for name in SP_ALL:
        for quantized in (True, False):
            tag = "fp8" if quantized else "hp"
            shape, dim = SP_SCALED_SHAPES["b2_s64"] if name in SP_SCALED else SP_SHAPES["b2_s16"]
            run = isolated(sp_layer, name, shape, dim, quantized, True)
            out[f"checkpointed.{name}.{tag}"] = run
    for i, name in enumerate(SP_LLAMA):
        for mode in ("fp8", "hp"):
            out[f"llama.{name}.{mode}"] = isolated(sp_llama, name, mode)
        if i % world == rank:  # the single-process runs, shared out over the ranks
            out[f"llama.{name}.single"] = isolated(sp_llama, name, "single")
    return out


base.SECTIONS["sp_fp8"] = section_sp_fp8
