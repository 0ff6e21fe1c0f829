"""fastcast over torch.distributed.

- ``amax``: max-reduction of amaxes over a process group (delayed and current scaling);
- ``tensor_parallel``: ``fc.Linear`` whose weight is a DTensor sharded by
  ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``): GEMMs on the local
  shards, amaxes reduced over the tensor-parallel group where a scale spans the shards.

Importing this package does not import ``torch.distributed`` (``import fastcast`` stays
cheap); the submodules import it when they are used.
"""

from __future__ import annotations

import sys
from typing import Any

from .amax import all_reduce_max

__all__ = ["all_reduce_max", "is_dtensor"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing ``torch.distributed.tensor`` (if it
    was never imported, no tensor can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def tensor_parallel_forward(*args: Any) -> Any:
    """``tensor_parallel.linear_forward`` (imported on first use: it needs DTensor)."""
    from .tensor_parallel import linear_forward  # noqa: PLC0415 - torch.distributed.tensor

    return linear_forward(*args)
