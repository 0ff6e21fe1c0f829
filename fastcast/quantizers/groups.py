"""Rows in groups (mixture-of-experts tokens, sorted by expert; experts' weight rows) and
the quantizer capability over them, ``quantize_groups``.

A quantizer quantizes each group as if it were a tensor of its own. Scales that span rows
(per-tensor, NVFP4's tensor scale) are then per group, and a column-wise layout (along
the rows: what a GEMM contracting over the tokens reads) has its blocks inside one group,
the caller having moved each group to a start that is a multiple of the quantizer's
``token_block`` (``pad_groups``). Group sizes never leave the device: the built-in
quantizers work by device-side index arithmetic; any other quantizer is called once per
group (``quantize_groups`` here), which reads the sizes on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..tensor import QuantizedTensor


@dataclasses.dataclass(frozen=True)
class TokenGroups:
    """The groups of a matrix's rows: ``ids`` (int64 ``[R]``) the group of each row,
    ``count`` how many groups. ``alignment``: every group starts at a multiple of it
    (``pad_groups``); ``size``: every group's row count where all are equal and known from
    the shapes (an expert's weight rows), else None."""

    ids: torch.Tensor
    count: int
    alignment: int = 1
    size: int | None = None

    @classmethod
    def uniform(cls, count: int, size: int, device: torch.device) -> TokenGroups:
        """``count`` consecutive groups of ``size`` rows each."""
        ids = torch.arange(count, device=device).repeat_interleave(size)
        return cls(ids, count, size, size)

    def aligned(self, block: int) -> bool:
        """Whether blocks of ``block`` rows from each group's start stay inside it."""
        return self.alignment % block == 0

    def amax(self, row_amax: torch.Tensor) -> torch.Tensor:
        """Per-group max of per-row amaxes (FP32 ``[count]``; 0 for an empty group)."""
        return group_amax(row_amax, self.ids, self.count)


def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group (expert) of each of ``rows`` sorted rows, int64 ``[rows]``: the first
    group whose end lies beyond the row. Rows past the last end count to the last group."""
    index = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    gid = torch.searchsorted(offs, index, right=True)
    return gid.clamp_(max=offs.shape[0] - 1)


def padded_rows(rows: int, groups: int, block: int) -> int:
    """Rows of the padded buffer: every group rounded up to ``block`` fits, whatever the
    sizes (a bound from the shapes alone, so nothing is read back from the device)."""
    return -(-(rows + groups * (block - 1)) // block) * block


def pad_groups(
    m: torch.Tensor, offs: torch.Tensor, gid: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``m`` ``[T, D]`` with each group's rows moved to a start that is a multiple of
    ``block`` and the gaps zero: ``(padded [Tp, D], padded ends [E] int32, group of each
    padded row [Tp])``. Zero rows add nothing to a product over the tokens, nor to an
    amax. Device-side only: positions come from the counts by index arithmetic."""
    if block == 1:
        return m, offs, gid
    rows, groups = m.shape[0], offs.shape[0]
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + (block - 1)).div_(block, rounding_mode="floor").mul_(block)
    ends_p = torch.cumsum(padded, 0)
    shift = (ends_p - padded) - (ends - counts)  # new start minus old start, per group
    dest = torch.arange(rows, device=m.device) + shift[gid]
    total = padded_rows(rows, groups, block)
    out = m.new_zeros(total, m.shape[1]).index_copy_(0, dest, m)
    ends_p32 = ends_p.to(torch.int32)
    return out, ends_p32, group_ids(ends_p32, total)


def group_amax(amax: torch.Tensor, gid: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-group max of per-row amaxes (FP32 ``[groups]``; 0 for an empty group)."""
    out = torch.zeros(groups, dtype=torch.float32, device=amax.device)
    return out.scatter_reduce_(0, gid, amax, "amax", include_self=True)


def quantize_groups(
    quantizer: Any, m: torch.Tensor, groups: TokenGroups, columnwise: bool = False
) -> QuantizedTensor | list[QuantizedTensor]:
    """``m`` ``[R, D]`` quantized group by group: along D (the row-wise layout), or with
    ``columnwise`` along the rows within each group. The quantizer's own
    ``quantize_groups`` where it has one (None from it: not for these groups), else one
    ``quantize`` per group, in order (the sizes read on the host unless ``groups.size``
    gives them), each group's result one item of the list."""
    native = getattr(quantizer, "quantize_groups", None)
    if native is not None:
        result = native(m, groups, columnwise=columnwise)
        if result is not None:
            return result
    if groups.size is not None:
        sizes = [groups.size] * groups.count
    else:  # (the default for quantizers without the capability: a read back)
        sizes = torch.bincount(groups.ids, minlength=groups.count).tolist()
    parts, start = [], 0
    for size in sizes:
        part = m[start : start + size]
        start += size
        if size:
            parts.append(quantizer.quantize(part, rowwise=not columnwise, columnwise=columnwise))
    return parts


def dequantize_groups(q: QuantizedTensor | list[QuantizedTensor]) -> torch.Tensor:
    """FP32 ``[R, D]`` of ``quantize_groups``' result: what a GEMM emulation reads (a
    column-wise layout as it is: transformed, if it holds a Hadamard transform)."""
    if isinstance(q, QuantizedTensor):
        return _values(q)
    return torch.cat([_values(part) for part in q])


def _values(q: QuantizedTensor) -> torch.Tensor:
    if q.data is not None:
        return q.dequantize_rowwise_2d()
    return q.columnwise_operand().dequantize_rowwise_2d().t()
