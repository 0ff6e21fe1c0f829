"""fastcast over torch.distributed.

- ``amax``: max-reduction of amaxes over a process group (delayed and current scaling);
- ``collectives``: the all-gather fastcast runs itself (sequence parallelism's quantized
  input, the FSDP2 weight layouts gathered outside FSDP2);
- ``is_dtensor``: whether a weight is sharded by ``parallelize_module`` (what an
  ``fc.Linear`` then runs is ``fastcast.nn.tensor_parallel``: GEMMs on the local shards,
  amaxes reduced over the tensor-parallel group where a scale spans the shards).

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
