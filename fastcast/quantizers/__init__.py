"""Quantizers, one module per scaling family. Which recipe uses which is its scheme's
business (``fastcast.schemes``)."""

from __future__ import annotations

from .base import ROLES, Quantizer
from .block import BlockScalingQuantizer
from .mx import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer
from .reduction import GroupMax, all_reduce_max
from .rowwise import RowwiseQuantizer
from .sharded import ShardedNVFP4Quantizer, ShardedRowwiseQuantizer
from .tensorwise import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    FixedScaleQuantizer,
)

__all__ = [
    "ROLES",
    "BlockScalingQuantizer",
    "CurrentScalingQuantizer",
    "DelayedScalingQuantizer",
    "FixedScaleQuantizer",
    "GroupMax",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "Quantizer",
    "RowwiseQuantizer",
    "ShardedNVFP4Quantizer",
    "ShardedRowwiseQuantizer",
    "all_reduce_max",
]
