"""Sequence parallelism: the FP8 all-gather of a column-parallel layer's input.

With sequence parallelism each rank holds a slice of the tokens (``Shard(1)`` after a
``SequenceParallel`` norm, say) and a column-parallel layer needs them all. torch's
``ColwiseParallel(input_layouts=Shard(1))`` all-gathers the slices in high precision
before the layer runs; ``fastcast.distributed.QuantizedColwiseParallel`` hands the layer
its slice instead (torchao's ``Float8ColwiseParallel`` is the model), and an ``fc.Linear``
given a sequence-sharded input runs here. Under an enabled ``fc.autocast`` with a
per-tensor recipe (``Float8CurrentScaling``, ``DelayedScaling``) each rank casts its own
slice to FP8 with the *global* scale and the group all-gathers the FP8 codes, one
``uint8`` collective; the forward GEMM takes the gathered operand as it is:

- ``Float8CurrentScaling``: the slice's amax is max-reduced over the autocast's
  ``amax_reduction_group`` (the tensor-parallel group when none is given), as for any
  tensor-parallel input, so every rank casts with the scale of the whole input;
- ``DelayedScaling``: every rank casts with its history's scale (the same on all ranks)
  and records its slice's amax; the end-of-step reduction over the autocast's group (which
  tensor parallelism requires to contain the TP group) makes it the whole input's amax.

Casting with one scale is elementwise, so the gathered codes are those one process gets
quantizing the gathered high-precision input: the output, the gradients and the delayed
histories equal the high-precision gather's bit for bit. Backward: the weight-gradient
GEMM takes the transposed gathered codes (no second gather); the input gradient (each
rank's a partial sum over its output features) is reduce-scattered back to the slices in
the gradient's dtype, by DTensor's ``Partial -> Shard`` redistribution, as the
high-precision path does. Per-tensor scales need nothing else gathered.

Layers given the same input DTensor (q/k/v, or gate/up, after a ``SequenceParallel`` norm)
share one gather under current scaling (equal quantizers, the same global scale and
codes), where torch's style gathers once per layer; delayed scaling's scales are each
layer's own, so each of its layers gathers.

The layer all-gathers the input in high precision itself (DTensor's redistribution: the
same results as ``ColwiseParallel``'s gather) for every other recipe (row-wise, block,
MXFP8, NVFP4: their column-wise layouts scale along the tokens, so the weight gradient
would need a second, column-wise gather; and ``CustomRecipe``); for an input sharded
unevenly (a sequence length not a multiple of the group size), along the feature dim or
over more than one mesh dim; for an empty input; and in code ``torch.compile`` traces.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard

from ..gemm import operands_product
from ..quantizers.base import transposed_codes
from ..quantizers.tensorwise import CurrentScalingQuantizer
from ..recipe import DelayedScaling, Float8CurrentScaling
from ..reference.cast import as_matrix
from ..tensor import WHOLE, Float8Tensor
from .function import _restore_tensors, _strip_tensors, forward_gemm

__all__ = ["PER_TENSOR", "GatheredLinear", "InputGather", "input_gather"]

# Recipes whose input is gathered in FP8 (one scale per tensor: nothing but codes to move).
PER_TENSOR = (Float8CurrentScaling, DelayedScaling)


def input_gather(x: DTensor, mesh: Any, recipe: Any) -> InputGather | None:
    """The FP8 gather of a layer's sequence-sharded input ``x`` under ``recipe``, or None
    where the high-precision gather runs (see the module docstring)."""
    if not isinstance(recipe, PER_TENSOR) or len(x.placements) != 1:
        return None
    if torch.compiler.is_compiling():
        return None
    placement = x.placements[0]
    ndim = x.dim()
    if not isinstance(placement, Shard) or ndim < 2 or x.numel() == 0:
        return None
    dim = placement.dim % ndim
    world = mesh.size()
    if dim == ndim - 1 or x.shape[dim] % world:
        return None
    return InputGather(mesh, world, dim, x.shape)


class InputGather:
    """The FP8 all-gather of one call's input: ``Shard(dim)`` of ``shape`` over ``mesh``
    (even slices)."""

    __slots__ = ("mesh", "group", "world", "dim", "shape", "lead")

    def __init__(self, mesh: Any, world: int, dim: int, shape: torch.Size) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world = world
        self.dim = dim
        self.shape = shape  # the gathered (global) shape
        self.lead = math.prod(shape[:dim])  # how many slices each rank's tokens form

    def gathered(self, source: DTensor, x: torch.Tensor, quantizer: Any) -> Float8Tensor:
        """The whole input, quantized by the per-tensor ``quantizer`` (row-wise layout),
        from ``x``, this rank's slice of ``source``.

        Layers given the same input DTensor (q/k/v or gate/up projections after a
        ``SequenceParallel`` norm) share one gather under current scaling: equal
        quantizers and the same input give the same global amax, scale and codes. The
        gather is kept on ``source`` (it goes with it) while ``source`` is unchanged (its
        version counters). Delayed scaling's scales are each layer's own and change at the
        end of the step: each layer gathers its own."""
        shareable = type(quantizer) is CurrentScalingQuantizer
        if shareable:
            versions = (source._version, x._version)
            kept = getattr(source, _SHARED, None)
            if kept is not None and kept[:3] == (quantizer, self.mesh, versions):
                return kept[3]
        # (Detached: outside the autograd Function nothing of the cast may be recorded.)
        local = quantizer.quantize(x.detach(), rowwise=True, columnwise=False)
        x_q = Float8Tensor.assemble(
            local.fmt,
            self.shape,
            local.dtype,
            self._all_gather(local.data),
            local.scale_inv,  # the one global scale, the same on every rank
            WHOLE,
            None,
            None,
            WHOLE,
        )
        if shareable:
            setattr(source, _SHARED, (quantizer, self.mesh, versions, x_q))
        return x_q

    def _all_gather(self, codes: torch.Tensor) -> torch.Tensor:
        """Every rank's codes, one ``uint8`` collective, in the global token order."""
        if self.world == 1:
            return codes
        send = codes.contiguous().view(torch.uint8).view(-1)
        recv = send.new_empty(self.world * send.numel())
        # (torch 2.13 deprecates all_gather_into_tensor for all_gather_single.)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(recv, send, group=self.group)
        # [world, lead, slice] -> [lead, world, slice]: rank r's slice of each leading
        # index goes to position r along the sharded dim (a copy only when lead > 1).
        out = recv.view(self.world, self.lead, -1).transpose(0, 1).reshape(self.shape)
        return out.view(codes.dtype)

    def linear(
        self,
        source: DTensor,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        call: Any,
        cache: Any,
        first: bool | None,
        autograd: bool,
    ) -> torch.Tensor:
        """The layer's local output ``[*shape[:-1], N_local]`` over the gathered tokens:
        ``source`` is the sequence-sharded input, ``x`` this rank's slice of it (as the
        autograd graph has it), ``call`` a per-tensor recipe's."""
        x_q = self.gathered(source, x, call.input_q)
        if not autograd:
            return forward_gemm(x, w, b, call, cache, first, False, False, x_q=x_q)[0]
        return GatheredLinear.apply(x, w, b, call, cache, first, x_q, (self.mesh, self.dim))


# The attribute of an input DTensor that keeps its gather for the next layer given it.
_SHARED = "_fc_fp8_gathered"


def _with_columnwise(x_q: Float8Tensor) -> Float8Tensor:
    """``x_q`` with its column-wise layout: per-tensor casts are elementwise, so it is the
    transposed codes (a view), with the same scale."""
    out = x_q._clone_meta()
    out.data_t = transposed_codes(as_matrix(x_q.data))
    out.scale_inv_t, out.block_t = x_q.scale_inv, WHOLE
    return out


def _reduce_scatter(dgrad: torch.Tensor, mesh: Any, dim: int) -> torch.Tensor:
    """This rank's slice of the summed input gradient (each rank's ``dgrad`` is a partial
    sum over its output features), in ``dgrad``'s dtype: DTensor's ``Partial -> Shard``
    redistribution, the one the high-precision gather's backward runs."""
    partial = DTensor.from_local(dgrad, mesh, [Partial()], run_check=False)
    return partial.redistribute(mesh, [Shard(dim)]).to_local()


class GatheredLinear(torch.autograd.Function):
    """``LinearFunction`` for a sequence slice ``x`` whose whole, quantized and
    all-gathered, is ``x_q``: backward reduce-scatters the input gradient to the slices
    (``scatter``: the mesh and the sharded dim). Per-tensor recipes only: every GEMM takes
    FP8 operands."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        call: Any,
        weight_cache: Any,
        first: bool | None,
        x_q: Float8Tensor,
        scatter: tuple[Any, int],
    ) -> torch.Tensor:
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        out, x_q, w_q = forward_gemm(
            x, weight, bias, call, weight_cache, first, need_dgrad, need_wgrad, x_q=x_q
        )
        # As LinearFunction: only the column-wise layouts, as tensors saved-tensor hooks see.
        saved = [
            _with_columnwise(x_q).columnwise_operand() if need_wgrad else None,
            w_q.columnwise_operand() if need_dgrad else None,
        ]
        tensors, ctx.shells = _strip_tensors(saved)
        ctx.save_for_backward(*tensors)
        ctx.call, ctx.scatter, ctx.shape = call, scatter, x_q.shape
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        x_t, w_t = _restore_tensors(ctx.saved_tensors, ctx.shells)
        call = ctx.call
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        dgrad = wgrad = bgrad = None
        if need_dgrad or need_wgrad:
            g_q = call.grad_q.quantize(g2d, rowwise=need_dgrad, columnwise=need_wgrad)
        if need_dgrad:  # [T, N_local] @ [N_local, K]: a partial sum over output features
            dgrad = operands_product(g_q, w_t, x_dtype).reshape(ctx.shape)
            dgrad = _reduce_scatter(dgrad, *ctx.scatter)
        if need_wgrad:  # [N_local, T] @ [T, K], over every gathered token
            wgrad = operands_product(g_q.columnwise_operand(), x_t, w_dtype)
        if need_bgrad:
            bgrad = g2d.sum(dim=0, dtype=torch.float32)
            if b_dtype != torch.float32:
                bgrad = bgrad.to(b_dtype)
        call.backward_done()
        return dgrad, wgrad, bgrad, None, None, None, None, None
