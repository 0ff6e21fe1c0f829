"""Tensor parallelism: ``fc.Linear`` with a weight sharded by ``parallelize_module``.

``parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})``
turns an ``fc.Linear``'s weight (and bias) into DTensors on a 1-D mesh. Inside an enabled
``fc.autocast`` such a layer runs here (``fc.Linear.forward`` hands it over): the GEMMs
take the *local* shards, quantized by the recipe's own quantizers, and the layer returns
DTensors with the placements the parallel styles expect, so their input and output
redistributions, and DTensor's autograd, do all the communication of activations and
gradients. Outside autocast the layer is ``F.linear`` on DTensors, as for ``nn.Linear``.

A scale that spans the sharded dimension must come from the whole tensor, so that every
rank quantizes its shard exactly as one process quantizes the whole tensor. The scheme
decides how (``Scheme.sharded_plan``, given the roles each style splits): scales spanning
the split take amaxes max-reduced over the tensor-parallel group (per tensor, per row,
NVFP4's tensor scale); blocks along it stay local, and every shard boundary must fall on
a block boundary (a ``ValueError`` names the sizes otherwise); a stateful scheme reduces
its histories over the autocast's ``amax_reduction_group``, which must then contain the
tensor-parallel group; quantizers that say nothing (``CustomRecipe``'s) see their shards.

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
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..distributed.agreement import agree
from ..quantizers.base import ROLES, scale_blocks, shard_multiple
from ..runtime.state import AutocastFrame
from ..schemes import Plan, scheme_for
from .function import linear_gemms, plan_for
from .sequence_parallel import input_gather

# What the ranks' recipe check names (distributed.agreement).
_TP = "tensor (and sequence) parallelism"
COLWISE = "colwise"  # weight Shard(0): output features split
ROWWISE = "rowwise"  # weight Shard(1): input features (the contraction) split

__all__ = [
    "COLWISE",
    "ROWWISE",
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
    if x_local.numel() == 0:
        out = F.linear(x_local, w_local, b_local)
    else:
        plan = plan_for(module, frame, w_local, Sharding(style, mesh))
        cache = module._weight_cache
        out = linear_gemms(x_local, w_local, b_local, plan, cache, first, replay, record, gather)
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
        plan = plan_for(module, frame, w_local, Sharding(style, weight.device_mesh))
    except ValueError as exc:  # the forward names the layer likewise
        raise ValueError(f"{module._where()}: {exc}") from exc
    plan.calibrate(x_local, w_local)


# -- plans ---------------------------------------------------------------------------------

# The roles whose tensors each style splits across the group, and along which dim of
# their [R, K] view: the scheme's quantizers reduce what spans the split (over_shards).
_SPLITS = {
    # y[:, n-shard] = x @ W[n-shard].T: the weight's rows and the gradient's columns.
    COLWISE: {"weight": 0, "grad_output": 1},
    # y = x[:, k-shard] @ W[:, k-shard].T (summed): the contraction dim of both.
    ROWWISE: {"input": 1, "weight": 1},
}


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A tensor-parallel layer's place: its style and mesh. ``plan_for`` keeps the layer's
    plan while its frame and sharding stay (the style is one of two constants and the
    mesh the same object: equality is two identity tests)."""

    style: str
    mesh: Any

    def plan(self, module: Any, frame: AutocastFrame, weight: torch.Tensor) -> Plan:
        return _build_plan(module, frame, self.style, self.mesh, weight)


def _build_plan(module: Any, frame: AutocastFrame, style: str, mesh: Any, w: torch.Tensor) -> Plan:
    tp_group = mesh.get_group()
    if frame.group is not None:
        _check_contains(frame.group, tp_group)
    splits = _SPLITS[style]
    scheme = scheme_for(frame.recipe)
    plan = scheme.sharded_plan(frame, module._scheme_state, w.device, splits, tp_group)
    quantizers = dict(zip(ROLES, (plan.input_q, plan.weight_q, plan.grad_q)))
    block = math.lcm(
        *(shard_multiple(scale_blocks(quantizers[role]), dim) for role, dim in splits.items())
    )
    if block > 1:
        _check_blocks(w, style, block, frame.recipe)
    return plan


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
