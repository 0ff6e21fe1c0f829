"""Sequence parallelism: the quantized all-gather of a column-parallel layer's input.

With sequence parallelism each rank holds a slice of the tokens and a column-parallel
layer needs them all. ``fastcast.distributed.QuantizedColwiseParallel`` hands an
``fc.Linear`` its slice, and under an enabled ``fc.autocast`` the layer runs here: each
rank quantizes its slice's row-wise layout with the plan's input quantizer
``over_shards`` the tokens (scales spanning the tokens from amaxes max-reduced over the
group), and the group all-gathers the codes, with the scales where they are per token,
in one ``uint8`` collective; the forward GEMM takes the gathered operand. (The GEMMs are
``nn.function.LinearFunction``'s; ``InputGather`` is its input gather hook.) The weight
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
from ..quantizers.base import (
    PER_TENSOR_BLOCKS,
    is_pure,
    over_group_shards,
    shard_multiple,
    transposed_codes,
)
from ..reference.cast import as_matrix
from ..runtime.state import gathered_inputs
from ..schemes import scheme_for
from ..tensor import WHOLE, QuantizedTensor

__all__ = ["InputGather", "input_gather"]


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
    return InputGather(x, mesh, world, dim, scaled)


class InputGather:
    """The quantized all-gather of one call's input ``source``: ``Shard(dim)`` over
    ``mesh`` (even slices). ``scaled``: the row-wise layout has scales per token (every
    recipe but the per-tensor ones), which travel with the codes, and backward gathers
    the column-wise layout each rank made of its slice. ``LinearFunction`` calls it
    (``nn.function.GatheredInput``)."""

    __slots__ = ("source", "mesh", "group", "world", "dim", "shape", "lead", "scaled")

    def __init__(
        self, source: DTensor, mesh: Any, world: int, dim: int, scaled: bool = False
    ) -> None:
        self.source = source
        shape = source.shape
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
        return over_group_shards(quantizer, self.group, 0)

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
        The state manager keeps the gather by ``source`` (``runtime.state.gathered_inputs``:
        it goes with ``source``) while ``source`` is unchanged (its version counters).
        Delayed scaling's scales are each layer's own and change at the end of the step:
        each layer gathers its own."""
        quantizer = self.slice_quantizer(quantizer)
        columnwise = columnwise and self.scaled
        shareable = is_pure(quantizer)
        if shareable:
            versions = (source._version, x._version)
            kept = gathered_inputs.get(source)
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
            gathered_inputs[source] = (quantizer, self.mesh, versions, x_q, x_cols)
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

    # -- the GatheredInput hook of nn.function.LinearFunction ------------------------------
    def quantize(
        self, x: torch.Tensor, quantizer: Any, columnwise: bool
    ) -> tuple[QuantizedTensor, QuantizedTensor | None]:
        """The gathered row-wise operand (``gathered``) and, with ``columnwise``, what the
        weight gradient needs: this rank's column-wise operand, gathered in backward
        (``columns``), or the transposed gathered codes (per-tensor recipes)."""
        x_q, x_cols = self.gathered(self.source, x, quantizer, columnwise)
        if not columnwise:
            return x_q, None
        if x_cols is not None:  # 1/world of the operand; a copy of the shell (the
            return x_q, x_cols._clone_meta()  # Function strips it, the kept gather not)
        return x_q, _with_columnwise(x_q).columnwise_operand()

    def columns(self, x_t: QuantizedTensor) -> QuantizedTensor:
        """The whole input's column-wise operand: the second quantized gather, where each
        rank kept its slice's (scaled recipes)."""
        return self.gather_columns(x_t) if self.scaled else x_t

    def scatter(self, dgrad: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the summed input gradient (each rank's ``dgrad`` is a
        partial sum over its output features), in ``dgrad``'s dtype: DTensor's ``Partial
        -> Shard`` redistribution, the one the high-precision gather's backward runs."""
        partial = DTensor.from_local(
            dgrad.reshape(self.shape), self.mesh, [Partial()], run_check=False
        )
        return partial.redistribute(self.mesh, [Shard(self.dim)]).to_local()


def _with_columnwise(x_q: QuantizedTensor) -> QuantizedTensor:
    """A per-tensor ``x_q`` with its column-wise layout: per-tensor casts are elementwise,
    so it is the transposed codes (a view), with the same scale."""
    out = x_q._clone_meta()
    out.data_t = transposed_codes(as_matrix(x_q.data))
    out.scale_inv_t, out.block_t = x_q.scale_inv, WHOLE
    return out
