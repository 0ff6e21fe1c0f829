"""Collectives fastcast calls itself (FSDP2's and DTensor's run through torch)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_into"]


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group: Any) -> None:
    """Every rank's ``t`` into ``out`` (``world`` times its size, rank order along dim 0):
    ``all_gather_single``, FSDP2's own collective (torch 2.13 deprecates
    ``all_gather_into_tensor`` for it), where torch has it. Looked up at each call, so
    that a wrapper set on ``torch.distributed`` (the tests' byte counters) sees it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)
