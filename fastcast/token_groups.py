"""Rows in groups: mixture-of-experts tokens sorted by expert, and experts' weight rows.

A value type and its index arithmetic, shared by the quantizers (``quantize_groups``) and
the grouped GEMMs. Group sizes never leave the device: every per-group position comes
from the counts by device-side index arithmetic.
"""

from __future__ import annotations

import dataclasses

import torch


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
