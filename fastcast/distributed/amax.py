"""Amax reduction over torch.distributed process groups (defined with the quantizers,
which run it; re-exported here, where users look for it)."""

from __future__ import annotations

from ..quantizers.reduction import GroupMax, all_reduce_max

__all__ = ["GroupMax", "all_reduce_max"]
