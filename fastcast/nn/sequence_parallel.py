"""Sequence parallelism: the quantized all-gather of a column-parallel layer's input.

With sequence parallelism each rank holds a slice of the tokens and a column-parallel
layer needs them all. ``fastcast.distributed.QuantizedColwiseParallel`` hands an
``fc.Linear`` its slice, and under an enabled ``fc.autocast`` the layer runs here: each
rank quantizes its slice's row-wise layout with the plan's input quantizer
``over_shards`` the tokens (scales spanning the tokens from amaxes max-reduced over the
group), and the group all-gathers the codes, with the scales where they are per token,
in one ``uint8`` collective; the forward GEMM takes the gathered operand. The weight
gradient contracts over the tokens: one scale for the whole tensor makes its operand the
transposed gathered codes; otherwise each rank keeps its slice's column-wise layout,
which backward all-gathers (a second collective).

The invariant: the operands are those one process makes of the gathered input, so the
outputs, gradients and delayed histories equal the high-precision gather's bit for bit.
Which inputs can be gathered so is the scheme's geometry (``Scheme.scale_blocks`` of the
input: each rank's run of consecutive tokens a multiple of the blocks along the tokens);
the rest are gathered in high precision (DTensor's redistribution): quantizers that do
not tell their geometry (``CustomRecipe``'s), a weight gradient in high precision, an
uneven or feature-dim shard, an empty input, and code ``torch.compile`` traces. Layers
given the same input DTensor share one forward gather where the quantizer is ``pure``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Shard

from ..distributed.collectives import all_gather_into
from ..gemm import operands_product
from ..quantizers.base import (
    PER_TENSOR_BLOCKS,
    is_pure,
    over_shards,
    shard_multiple,
    transposed_codes,
)
from ..quantizers.reduction import GroupMax
from ..reference.cast import as_matrix
from ..schemes import scheme_for
from ..tensor import WHOLE, QuantizedTensor
from .function import _restore_tensors, _strip_tensors, bias_grad, forward_gemm

__all__ = ["GatheredLinear", "InputGather", "input_gather"]


def _token_block(recipe: Any) -> tuple[int, bool] | None:
    """What each rank's run of tokens must be a multiple of for ``recipe``'s quantized
    gather (the input's blocks along the tokens, in either layout), and whether its
    row-wise scales are per token (travelling with the codes); None where the input is
    gathered in high precision (a weight gradient that takes it, geometry not known)."""
    scheme = scheme_for(recipe)
    if scheme.wgrad_high_precision(recipe):
        return None  # its wgrad takes the high-precision input: gathered as it is
    blocks = scheme.scale_blocks(recipe, "input")
    if blocks is None:
        return None
    return shard_multiple(blocks, 0), blocks[0][0] != PER_TENSOR_BLOCKS[0][0]


def input_gather(x: DTensor, mesh: Any, recipe: Any) -> InputGather | None:
    """The quantized gather of a layer's sequence-sharded input ``x`` under ``recipe``,
    or None where the high-precision gather runs (see the module docstring)."""
    geometry = _token_block(recipe)
    if geometry is None or len(x.placements) != 1:
        return None
    block, scaled = geometry
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
    # The rows ([R, K] view) of each rank form runs of this many consecutive tokens.
    run = x.shape[dim] // world * math.prod(x.shape[dim + 1 : -1])
    if run % block:
        return None
    return InputGather(mesh, world, dim, x.shape, scaled)


class InputGather:
    """The quantized all-gather of one call's input: ``Shard(dim)`` of ``shape`` over
    ``mesh`` (even slices). ``scaled``: the row-wise layout has scales per token (every
    recipe but the per-tensor ones), which travel with the codes, and backward gathers
    the column-wise layout each rank made of its slice."""

    __slots__ = ("mesh", "group", "world", "dim", "shape", "lead", "scaled")

    def __init__(
        self, mesh: Any, world: int, dim: int, shape: torch.Size, scaled: bool = False
    ) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world = world
        self.dim = dim
        self.shape = shape  # the gathered (global) shape
        self.lead = math.prod(shape[:dim])  # how many slices each rank's tokens form
        self.scaled = scaled

    def slice_quantizer(self, quantizer: Any) -> Any:
        """``quantizer`` (the plan's, for a replicated input) for a slice of the tokens:
        the scales spanning the tokens come from the whole input's amaxes, max-reduced over
        the group (row-wise: the column-wise layout's per-feature scales; NVFP4: the
        tensor scales). Block scales along the tokens are local (``input_gather``)."""
        return over_shards(quantizer, GroupMax(self.group), 0)

    def gathered(
        self, source: DTensor, x: torch.Tensor, quantizer: Any, columnwise: bool = False
    ) -> tuple[QuantizedTensor, QuantizedTensor | None]:
        """The whole input, quantized by ``quantizer`` (row-wise layout), from ``x``, this
        rank's slice of ``source``; with ``columnwise`` (scaled recipes), the column-wise
        layout of the slice too, as an operand (``[K, tokens of the slice]``) that
        ``gather_columns`` completes in backward.

        Layers given the same input DTensor (q/k/v or gate/up projections after a
        ``SequenceParallel`` norm) share one gather where the quantizer depends on its
        input alone: equal quantizers and the same input give the same codes and scales.
        The gather is kept on ``source`` (it goes with it) while ``source`` is unchanged
        (its version counters). Delayed scaling's scales are each layer's own and change
        at the end of the step: each layer gathers its own."""
        quantizer = self.slice_quantizer(quantizer)
        columnwise = columnwise and self.scaled
        shareable = is_pure(quantizer)
        if shareable:
            versions = (source._version, x._version)
            kept = getattr(source, _SHARED, None)
            if (
                kept is not None
                and kept[:3] == (quantizer, self.mesh, versions)
                and (kept[4] is not None or not columnwise)
            ):
                return kept[3], kept[4]
        # (Detached: outside the autograd Function nothing of the cast may be recorded.)
        local = quantizer.quantize(x.detach(), rowwise=True, columnwise=columnwise)
        x_q = local.rowwise_operand()
        x_q.shape = self.shape
        # One uint8 collective: the codes and, where they are per token, the scales.
        parts = [local.data] + ([local.scale_inv] if self.scaled else [])
        gathered = self._rows(parts)
        x_q.data = gathered[0]
        if self.scaled:
            x_q.scale_inv = gathered[1]
        x_cols = local.columnwise_operand() if columnwise else None
        if shareable:
            setattr(source, _SHARED, (quantizer, self.mesh, versions, x_q, x_cols))
        return x_q, x_cols

    def gather_columns(self, x_cols: QuantizedTensor) -> QuantizedTensor:
        """The column-wise operand ``[K, R]`` of the whole input from each rank's
        ``[K, R/world]`` (``gathered``'s ``x_cols``): codes and block scales, one uint8
        collective (the row-wise recipe's per-feature scales, the same on every rank, and
        NVFP4's tensor scale stay as they are)."""
        out = x_cols._clone_meta()
        # Row-wise recipe: one scale per feature ([K, 1]) over every token, reduced.
        gather_scales = x_cols.block != (1, 0)
        parts = [x_cols.data] + ([x_cols.scale_inv] if gather_scales else [])
        gathered = self._columns(parts)
        out.data = gathered[0]
        if gather_scales:
            out.scale_inv = gathered[1]
        k = x_cols.shape[0]
        out.shape = torch.Size((k, x_cols.shape[1] * self.world))
        return out

    def _all_gather(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """Every rank's ``parts`` as bytes, one ``uint8`` collective: ``[world, total]``,
        and each part's byte count."""
        chunks = [p.contiguous().view(torch.uint8).reshape(-1) for p in parts]
        sizes = [c.numel() for c in chunks]
        send = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        recv = send.new_empty(self.world * send.numel())
        all_gather_into(recv, send, self.group)
        return recv.view(self.world, -1), sizes

    def _rows(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Row-major local tensors (the codes shaped like the slice; scales ``[rows, n]``)
        gathered in the global token order."""
        if self.world == 1:
            return parts
        recv, sizes = self._all_gather(parts)
        out, offset = [], 0
        for i, (part, size) in enumerate(zip(parts, sizes)):
            mine = recv[:, offset : offset + size]
            offset += size
            # [world, lead, slice] -> [lead, world, slice]: rank r's slice of each leading
            # index goes to position r along the sharded dim (a copy unless lead is 1).
            dim = self.dim if i == 0 else 0
            shape = list(part.shape)
            shape[dim] *= self.world
            joined = mine.reshape(self.world, self.lead, -1).transpose(0, 1)
            joined = joined.reshape(-1, shape[-1] * part.element_size())
            out.append(joined.contiguous().view(part.dtype).reshape(shape))
        return out

    def _columns(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Column-wise local tensors ``[K', R']`` (tokens along the last dim) gathered in
        the global token order: ``[K', world * R']``."""
        if self.world == 1:
            return parts
        recv, sizes = self._all_gather(parts)
        out, offset = [], 0
        for part, size in zip(parts, sizes):
            mine = recv[:, offset : offset + size]
            offset += size
            rows = part.shape[0]
            # [world, K', lead, run] -> [K', lead, world, run]
            joined = mine.reshape(self.world, rows, self.lead, -1).permute(1, 2, 0, 3)
            joined = joined.reshape(rows, -1)
            out.append(joined.contiguous().view(part.dtype))
        return out

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
        autograd graph has it), ``call`` the recipe's per-call object."""
        need_wgrad = autograd and w.requires_grad
        x_q, x_cols = self.gathered(source, x, call.input_q, need_wgrad)
        if not autograd:
            return forward_gemm(x, w, b, call, cache, first, False, False, x_q=x_q)[0]
        return GatheredLinear.apply(x, w, b, call, cache, first, x_q, x_cols, self)


# The attribute of an input DTensor that keeps its gather for the next layer given it.
_SHARED = "_fc_fp8_gathered"


def _with_columnwise(x_q: QuantizedTensor) -> QuantizedTensor:
    """A per-tensor ``x_q`` with its column-wise layout: per-tensor casts are elementwise,
    so it is the transposed codes (a view), with the same scale."""
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
    all-gathered, is ``x_q``: backward reduce-scatters the input gradient to the slices,
    and the weight-gradient GEMM takes the whole input's column-wise layout: the
    transposed gathered codes (per-tensor recipes), or ``x_cols``, this rank's slice's
    column-wise layout, all-gathered by ``gather`` (the other recipes). Every GEMM takes
    quantized operands."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        call: Any,
        weight_cache: Any,
        first: bool | None,
        x_q: QuantizedTensor,
        x_cols: QuantizedTensor | None,
        gather: InputGather,
    ) -> torch.Tensor:
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        out, x_q, w_q = forward_gemm(
            x, weight, bias, call, weight_cache, first, need_dgrad, need_wgrad, x_q=x_q
        )
        if not need_wgrad:
            x_t = None
        elif x_cols is not None:  # 1/world of the operand: gathered in backward
            x_t = x_cols._clone_meta()  # (the shell is stripped; the kept gather is not)
        else:
            x_t = _with_columnwise(x_q).columnwise_operand()
        # As LinearFunction: only the column-wise layouts, as tensors saved-tensor hooks see.
        saved = [x_t, w_q.columnwise_operand() if need_dgrad else None]
        tensors, ctx.shells = _strip_tensors(saved)
        ctx.save_for_backward(*tensors)
        ctx.call, ctx.gather, ctx.shape = call, gather, x_q.shape
        ctx.gather_columns = x_cols is not None
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        x_t, w_t = _restore_tensors(ctx.saved_tensors, ctx.shells)
        call, gather = ctx.call, ctx.gather
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        dgrad = wgrad = bgrad = None
        if need_dgrad or need_wgrad:
            g_q = call.grad_q.quantize(g2d, rowwise=need_dgrad, columnwise=need_wgrad)
        if need_dgrad:  # [T, N_local] @ [N_local, K]: a partial sum over output features
            dgrad = operands_product(g_q, w_t, x_dtype).reshape(ctx.shape)
            dgrad = _reduce_scatter(dgrad, gather.mesh, gather.dim)
        if need_wgrad:  # [N_local, T] @ [T, K], over every gathered token
            if ctx.gather_columns:  # the second quantized gather
                x_t = gather.gather_columns(x_t)
            wgrad = operands_product(g_q.columnwise_operand(), x_t, w_dtype)
        if need_bgrad:
            bgrad = bias_grad(g2d, b_dtype)
        call.backward_done()
        return dgrad, wgrad, bgrad, None, None, None, None, None, None
