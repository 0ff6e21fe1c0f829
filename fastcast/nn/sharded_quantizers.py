"""Quantizers over a shard of a tensor split across ranks along a dim a scale spans:
they reduce the amaxes over the group first, so that each rank's codes and scales are
those one process gets for the whole tensor (tensor and sequence parallelism)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import torch

from ..distributed.amax import all_reduce_max
from ..quantizers.nvfp4 import NVFP4Quantizer
from ..quantizers.rowwise import RowwiseQuantizer
from ..tensor import Float8Tensor, NVFP4Tensor

__all__ = ["ShardedNVFP4Quantizer", "ShardedRowwiseQuantizer"]


@dataclasses.dataclass(frozen=True)
class ShardedRowwiseQuantizer:
    """``RowwiseQuantizer`` over a shard of a tensor split along a dim its rows span.

    ``reduce_rows``: the row-wise layout's rows (along K, the last dim) are split across
    ``group``, so each row's amax is max-reduced over it before the scale is made;
    ``reduce_columns`` likewise for the column-wise layout (rows of ``x.T``). The scales,
    and so the codes, are those the whole tensor gets from ``RowwiseQuantizer``.
    """

    base: RowwiseQuantizer
    group: Any
    reduce_rows: bool
    reduce_columns: bool

    @property
    def fmt(self) -> str:
        return self.base.fmt

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        reduce = functools.partial(all_reduce_max, group=self.group)
        return self.base.quantize(
            x,
            rowwise=rowwise,
            columnwise=columnwise,
            reduce_rows=reduce if self.reduce_rows else None,
            reduce_columns=reduce if self.reduce_columns else None,
        )


@dataclasses.dataclass(frozen=True)
class ShardedNVFP4Quantizer:
    """``NVFP4Quantizer`` over a shard of a tensor split across ``group``: the FP32
    tensor scale of each layout (and of the Hadamard-transformed column-wise layout)
    comes from the amax of the whole tensor, max-reduced over ``group``; the 16-element
    blocks (and 16x16 tiles) are local, as the shards are multiples of 16. The codes and
    scales are then those ``NVFP4Quantizer`` gives the whole tensor (stochastic rounding
    aside: its random draws are the shard's own)."""

    base: NVFP4Quantizer
    group: Any

    fmt: ClassVar[str] = "e2m1"

    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = False,
        generator: torch.Generator | None = None,
    ) -> NVFP4Tensor:
        return self.base.quantize(
            x,
            rowwise=rowwise,
            columnwise=columnwise,
            generator=generator,
            reduce_amax=functools.partial(all_reduce_max, group=self.group),
        )
