"""Tensor parallelism: ``fc.Linear`` with a weight sharded by ``parallelize_module``.

``parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})``
turns an ``fc.Linear``'s weight (and bias) into DTensors on a 1-D mesh. Inside an enabled
``fc.autocast`` such a layer runs here (``fc.Linear.forward`` hands it over): the GEMMs
take the *local* shards, quantized by the recipe's own quantizers, and the layer returns
DTensors with the placements the parallel styles expect, so their input and output
redistributions, and DTensor's autograd, do all the communication of activations and
gradients. Outside autocast the layer is ``F.linear`` on DTensors, as for ``nn.Linear``.

A scale that spans the sharded dimension must come from the whole tensor, so that every
rank quantizes its shard exactly as one process quantizes the whole tensor:

- per-tensor scales (``Float8CurrentScaling``): the weight's amax is max-reduced over the
  tensor-parallel group, input and gradient amaxes over the autocast's
  ``amax_reduction_group`` (the tensor-parallel group when none is given);
- ``DelayedScaling``: the amax histories are reduced by the autocast's
  ``amax_reduction_group``, which must then be given and contain the tensor-parallel
  group (the data-parallel x tensor-parallel world, say);
- ``Float8RowwiseScaling``: the row amaxes of the layouts whose rows run along the
  sharded dimension (``ColwiseParallel``: the gradient per token and the weight per input
  feature; ``RowwiseParallel``: the input per token and the weight per output feature)
  are max-reduced over the tensor-parallel group, one small all-reduce per layout;
- block scales (``Float8BlockScaling`` 128, ``MXFP8BlockScaling`` 32,
  ``NVFP4BlockScaling`` 16) are local when every shard boundary falls on a block
  boundary, which is required (a ``ValueError`` names the sizes otherwise);
  ``NVFP4BlockScaling``'s FP32 tensor scales of the sharded operands are max-reduced
  over the tensor-parallel group (``ShardedNVFP4Quantizer``);
- ``CustomRecipe``: its quantizers see the local shards as they are.

``ColwiseParallel`` (weight ``Shard(0)``): input replicated, output ``Shard(-1)``; the
input gradient is a partial sum that DTensor reduces. A sequence-sharded input (which
``fastcast.distributed.sequence_parallel.QuantizedColwiseParallel`` hands over as it is)
is all-gathered quantized by ``sequence_parallel`` where it can, else in high precision
here. ``RowwiseParallel`` (weight
``Shard(1)``): input ``Shard(-1)``; the output is the ``Partial`` sum of the ranks'
products, which the style's output redistribution reduces (an all-reduce for a
replicated output, a reduce-scatter for sequence parallelism's ``Shard(1)``), or, with a
bias, the all-reduced sum with the (replicated) bias added after it, once.

FSDP2 x TP (``parallelize_module`` over a 2-D mesh's TP dim, then ``fully_shard`` over its
data-parallel dim): FSDP2 all-gathers each weight over the data-parallel dim, in high
precision, into the 1-D TP DTensor this layer runs on; nothing else changes. A weight
gathered quantized (``quantized_all_gather=True``) is refused: its scale comes from the
data-parallel group's shards only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..distributed.agreement import agree
from ..recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from ..runtime.state import AutocastFrame
from ..schemes import Plan, scheme_for
from .function import LinearFunction, forward_gemm
from .sequence_parallel import InputGather, input_gather
from .sharded_quantizers import ShardedNVFP4Quantizer, ShardedRowwiseQuantizer

# What the ranks' recipe check names (distributed.agreement).
_TP = "tensor (and sequence) parallelism"
COLWISE = "colwise"  # weight Shard(0): output features split
ROWWISE = "rowwise"  # weight Shard(1): input features (the contraction) split

__all__ = [
    "COLWISE",
    "ROWWISE",
    "ShardedRowwiseQuantizer",
    "calibrate",
    "linear_forward",
    "replicated_input",
    "style_of",
]


def style_of(weight: DTensor, module: Any = None) -> str:
    """``COLWISE`` or ``ROWWISE`` from the weight's placement; clear errors otherwise
    (``NotImplementedError``s naming ``module``, the ``fc.Linear``, when given)."""
    mesh = weight.device_mesh
    if mesh.ndim == 1:
        placement = weight.placements[0]
        if isinstance(placement, Shard) and placement.dim in (0, -2):
            return COLWISE
        if isinstance(placement, Shard) and placement.dim in (1, -1):
            return ROWWISE
    where = "tensor parallel fc.Linear" if module is None else module._where()
    if mesh.ndim != 1:
        # FSDP2 x TP hands the layer the TP-sharded weight it gathered over the
        # data-parallel dim (1-D); a 2-D one is FSDP2's sharded parameter, not gathered.
        raise NotImplementedError(
            f"{where}: tensor parallelism needs the weight on a 1-D mesh, got a {mesh.ndim}-D "
            "one; for FSDP2 x TP, parallelize_module over the TP sub-mesh, fully_shard over "
            "the data-parallel one, and call the layer through a fully_shard-ed module (which "
            "gathers the weight)"
        )
    raise NotImplementedError(
        f"{where}: tensor parallelism supports weights sharded as ColwiseParallel (Shard(0)) "
        f"or RowwiseParallel (Shard(1)) place them, got {weight.placements[0]}"
    )


def replicated_input(x: DTensor, weight: Any) -> DTensor:
    """A column-parallel layer's input ``x`` all-gathered (high precision) where it is
    sharded: outside autocast an ``fc.Linear`` is ``F.linear`` on DTensors, and its
    ``QuantizedColwiseParallel`` hands over a sequence-sharded input as it is."""
    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1:
        return x
    if tuple(x.placements) == (Replicate(),) or style_of(weight) != COLWISE:
        return x
    return x.redistribute(weight.device_mesh, [Replicate()])


def linear_forward(
    module: Any,
    x: torch.Tensor,
    weight: DTensor,
    bias: torch.Tensor | None,
    frame: AutocastFrame,
    first: bool | None,
    replay: Any = None,
    record: Any = None,
) -> torch.Tensor:
    """``module``'s quantized forward with a DTensor ``weight`` (see the module docstring).

    ``ValueError``s are raised without the layer's name (``fc.Linear.forward`` puts it
    in front); ``NotImplementedError``s, which it passes through, name it here."""
    style = style_of(weight, module)
    mesh = weight.device_mesh
    agree(frame.recipe, weight.device, _TP, frame.group, mesh.get_group())
    replicate = [Replicate()]
    gather = None
    if style == COLWISE:
        if not isinstance(x, DTensor):  # a plain tensor is taken as the replicated input
            x = DTensor.from_local(x, mesh, replicate, run_check=False)
        elif tuple(x.placements) != (Replicate(),):  # e.g. sequence-sharded: all-gather,
            # in FP8 where sequence_parallel can (its GEMMs then take the local slice)
            gather = input_gather(x, mesh, frame.recipe)
            if gather is None:
                x = x.redistribute(mesh, replicate)
        if gather is not None:
            x_local = x.to_local()  # its gradient: this rank's slice, reduce-scattered
        else:
            # Each rank's input gradient is its shard's contribution: a partial sum.
            x_local = x.to_local(grad_placements=[Partial()])
    else:
        shard = [Shard(x.dim() - 1)]
        if not isinstance(x, DTensor):  # a plain tensor is taken as the local shard
            x = DTensor.from_local(x, mesh, shard, run_check=False)
        elif tuple(x.placements) != tuple(shard):
            x = x.redistribute(mesh, shard)
        x_local = x.to_local()
    w_local = weight.to_local()
    if hasattr(w_local, "fc_quantized"):
        # FSDP2 gathered this TP shard quantized (fc.convert(..., quantized_all_gather=True)),
        # with a scale from the data-parallel group's amax: not the whole weight's, which
        # the TP plan needs (and for per-tensor scales, reduces over the TP group too).
        raise NotImplementedError(
            f"{module._where()}: FSDP2 x tensor parallelism (a weight sharded by "
            "parallelize_module, then fully_shard) supports the high-precision FSDP2 "
            "all-gather only, not quantized_all_gather=True; convert with "
            "quantized_all_gather=False"
        )
    b_local = None
    if bias is not None and style == COLWISE:
        b_local = bias.to_local() if isinstance(bias, DTensor) else bias
    out = _local_linear(
        module, x_local, w_local, b_local, frame, style, mesh, first, replay, record, gather, x
    )
    if style == COLWISE:
        return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)
    # Partial products over the contraction shards. Without a bias the sum is left to
    # the parallel style's output redistribution, which reduces to the layout it wants:
    # an all-reduce for Replicate, a reduce-scatter (half the bytes) for sequence
    # parallelism's Shard(1). With one: an all-reduce, then the bias, added once.
    partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    if bias is None:
        return partial
    total = partial.redistribute(mesh, replicate)
    if not isinstance(bias, DTensor):
        bias = DTensor.from_local(bias, mesh, replicate, run_check=False)
    return total + bias.to(total.dtype)


def calibrate(module: Any, x: torch.Tensor, weight: DTensor, frame: AutocastFrame) -> None:
    """``fc.autocast(enabled=False, calibrating=True)`` on a tensor-parallel layer: the
    plan records the amaxes of the local shards, which the end-of-step reduction over the
    autocast's group (required for ``DelayedScaling``, as in training) makes the whole
    tensors' amaxes."""
    style = style_of(weight, module)
    agree(frame.recipe, weight.device, _TP, frame.group, weight.device_mesh.get_group())
    x_local = x.to_local() if isinstance(x, DTensor) else x
    w_local = weight.to_local()
    try:
        plan = _plan(module, frame, style, weight.device_mesh, w_local)
    except ValueError as exc:  # the forward names the layer likewise
        raise ValueError(f"{module._where()}: {exc}") from exc
    plan.calibrate(x_local, w_local)


def _local_linear(
    module: Any,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    frame: AutocastFrame,
    style: str,
    mesh: Any,
    first: bool | None,
    replay: Any,
    record: Any,
    gather: InputGather | None = None,
    source: DTensor | None = None,
) -> torch.Tensor:
    """The quantized linear of local tensors under the tensor-parallel plan; with
    ``gather``, ``x`` is this rank's slice of the sequence-sharded ``source``, which it
    all-gathers in FP8."""
    if x.numel() == 0:
        return F.linear(x, w, b)
    plan = _plan(module, frame, style, mesh, w)
    autograd = torch.is_grad_enabled() and (
        x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
    )
    call = plan.call(autograd, replay, record)
    cache = module._weight_cache
    if gather is not None:
        return gather.linear(source, x, w, b, call, cache, first, autograd)
    if not autograd:
        return forward_gemm(x, w, b, call, cache, first, False, False)[0]
    rows = x.numel() // x.shape[-1]
    align = plan.row_alignment
    if rows % align and w.requires_grad:  # as fc.Linear pads: zero rows, sliced off
        x2d = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % align))
        out = LinearFunction.apply(x2d, w, b, call, cache, first)[:rows]
        return out.view(*x.shape[:-1], out.shape[-1])
    return LinearFunction.apply(x, w, b, call, cache, first)


# -- plans ---------------------------------------------------------------------------------

# The block along each GEMM dim of the block-scaled recipes: shards must be multiples.
_BLOCKS = {Float8BlockScaling: 128, MXFP8BlockScaling: 32, NVFP4BlockScaling: 16}


def _plan(module: Any, frame: AutocastFrame, style: str, mesh: Any, w: torch.Tensor) -> Plan:
    """The module's tensor-parallel plan for ``frame``, kept until the frame's recipe or
    group, or the style or mesh, changes (identity tests, as ``fc.Linear``'s own plan)."""
    cached = module.__dict__.get("_fc_tp_plan")
    if (
        cached is not None
        and cached[0] is frame.recipe
        and cached[1] is frame.group
        and cached[2] == style
        and cached[3] is mesh
    ):
        return cached[4]
    plan = _build_plan(module, frame, style, mesh, w)
    module.__dict__["_fc_tp_plan"] = (frame.recipe, frame.group, style, mesh, plan)
    return plan


def _build_plan(module: Any, frame: AutocastFrame, style: str, mesh: Any, w: torch.Tensor) -> Plan:
    recipe = frame.recipe
    scheme = scheme_for(recipe)
    tp_group = mesh.get_group()
    if frame.group is not None:
        _check_contains(frame.group, tp_group)
    if isinstance(recipe, DelayedScaling):
        if frame.group is None:
            raise ValueError(
                "DelayedScaling on a tensor-parallel layer needs "
                "fc.autocast(amax_reduction_group=...) containing the tensor-parallel group, "
                "so that every shard's amax reaches the one history all ranks scale from"
            )
        return scheme.plan(frame, module._scheme_state, w.device)
    block = next((b for t, b in _BLOCKS.items() if isinstance(recipe, t)), None)
    if block is not None:
        _check_blocks(w, style, block, recipe)
    row_alignment = scheme.row_alignment(recipe)
    hp_wgrad = scheme.wgrad_high_precision(recipe)
    if isinstance(recipe, Float8CurrentScaling):
        # Input and gradient: over the autocast's group (or the TP group); the weight
        # shards of one tensor: over the TP group (the data-parallel replicas are equal).
        group = frame.group if frame.group is not None else tp_group
        quantizers = tuple(scheme.quantizer(recipe, role, group) for role in _ROLES)
        quantizers = (
            quantizers[0],
            dataclasses.replace(quantizers[1], amax_reduction_group=tp_group),
            quantizers[2],
        )
    elif isinstance(recipe, Float8RowwiseScaling):
        reduce = _ROWWISE_REDUCTIONS[style]
        quantizers = tuple(
            ShardedRowwiseQuantizer(scheme.quantizer(recipe, role), tp_group, *reduce[role])
            for role in _ROLES
        )
    elif isinstance(recipe, NVFP4BlockScaling):
        sharded = _NVFP4_SHARDED[style]
        quantizers = tuple(
            ShardedNVFP4Quantizer(q, tp_group) if role in sharded else q
            for role, q in zip(_ROLES, scheme.quantizers(recipe, frame.group))
        )
    else:
        quantizers = scheme.quantizers(recipe, frame.group)
    return Plan(recipe, frame.group, quantizers, row_alignment, hp_wgrad)


_ROLES = ("input", "weight", "grad_output")

# Row-wise recipe: (reduce the row-wise layout's row amaxes, reduce the column-wise
# layout's) per role, by style: reduced where that layout's rows run along the sharded dim.
_ROWWISE_REDUCTIONS = {
    # y[:, n-shard] = x @ W[n-shard].T; dgrad contracts over n (sharded), wgrad over tokens.
    COLWISE: {"input": (False, False), "weight": (False, True), "grad_output": (True, False)},
    # y = x[:, k-shard] @ W[:, k-shard].T (summed); forward contracts over k (sharded).
    ROWWISE: {"input": (True, False), "weight": (True, False), "grad_output": (False, False)},
}


# NVFP4: the roles whose tensor is split across the group (their tensor scales reduced).
_NVFP4_SHARDED = {COLWISE: ("weight", "grad_output"), ROWWISE: ("input", "weight")}


def _check_contains(group: Any, tp_group: Any) -> None:
    if not isinstance(group, dist.ProcessGroup):
        return
    ranks = set(dist.get_process_group_ranks(group))
    tp_ranks = dist.get_process_group_ranks(tp_group)
    if not ranks.issuperset(tp_ranks):
        raise ValueError(
            f"the autocast's amax_reduction_group (ranks {sorted(ranks)}) does not "
            f"contain the layer's tensor-parallel group (ranks {tp_ranks})"
        )


def _check_blocks(w: torch.Tensor, style: str, block: int, recipe: Any) -> None:
    """Every shard boundary on a block boundary: the local blocks are then the blocks of
    the whole tensor, and block scales need no communication."""
    local = w.shape[0] if style == COLWISE else w.shape[1]
    if local % block:
        what = "output features" if style == COLWISE else "input features"
        raise ValueError(
            f"tensor parallel: {type(recipe).__name__} scales blocks of {block} elements along the "
            f"tensor-parallel dimension, but this rank's shard has {local} {what}; choose "
            f"sizes whose shards are multiples of {block} (so that shard boundaries fall on "
            "block boundaries)"
        )
