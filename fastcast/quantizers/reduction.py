"""Amax max-reduction over a process group: the one collective a quantizer runs itself.

It sits with the quantizers, below every layer that reduces amaxes (schemes' delayed
updates, tensor and sequence parallelism, the FSDP2 gather), so none imports upward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def all_reduce_max(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """In-place ``all_reduce(MAX)`` of ``tensor`` over ``group`` (a no-op for one rank)."""
    import torch.distributed as dist  # noqa: PLC0415 - keeps import time low without it

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "an amax_reduction_group was given but torch.distributed is not initialized"
        )
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


@dataclasses.dataclass(frozen=True)
class GroupMax:
    """An amax reducer (``amax -> amax``, in place) over ``group``. A value: reducers over
    one group are equal, so quantizers holding them compare equal (shared gathers)."""

    group: Any

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        return all_reduce_max(amax, self.group)
