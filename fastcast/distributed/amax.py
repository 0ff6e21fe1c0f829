"""Amax reduction over torch.distributed process groups."""

from __future__ import annotations

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
