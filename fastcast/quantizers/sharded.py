"""Quantizers over a shard of a tensor split across ranks along a dim a scale spans
(``Quantizer.over_shards``): the amaxes go through a reducer first, so that each rank's
codes and scales are those the base quantizer gives the whole tensor."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..tensor import Float8Tensor, NVFP4Tensor
from .base import Blocks

if TYPE_CHECKING:  # the base quantizers import this module (their over_shards)
    from .nvfp4 import NVFP4Quantizer
    from .rowwise import RowwiseQuantizer

__all__ = ["ShardedNVFP4Quantizer", "ShardedRowwiseQuantizer"]

Reduce = Callable[[torch.Tensor], Any]


@dataclasses.dataclass(frozen=True)
class ShardedRowwiseQuantizer:
    """``RowwiseQuantizer`` over a shard: ``reduce_rows``, the row-wise layout's rows
    (along K) are split, so each row's amax goes through ``reduce`` before its scale is
    made; ``reduce_columns`` likewise for the column-wise layout (rows of ``x.T``)."""

    base: RowwiseQuantizer
    reduce: Reduce
    reduce_rows: bool
    reduce_columns: bool

    pure: ClassVar[bool] = True

    @property
    def fmt(self) -> str:
        return self.base.fmt

    @property
    def scale_blocks(self) -> Blocks:
        return self.base.scale_blocks

    def over_shards(self, reduce: Reduce, dim: int) -> ShardedRowwiseQuantizer:
        """Split along ``dim`` too (sequence parallelism's slice of a TP layer's input)."""
        return dataclasses.replace(
            self,
            reduce=reduce,
            reduce_rows=self.reduce_rows or dim == 1,
            reduce_columns=self.reduce_columns or dim == 0 or self.base.columnwise_per_tensor,
        )

    def shard_amax(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        return self.base.shard_amax(x, dim)

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        return self.base.quantize(
            x,
            rowwise=rowwise,
            columnwise=columnwise,
            reduce_rows=self.reduce if self.reduce_rows else None,
            reduce_columns=self.reduce if self.reduce_columns else None,
        )


@dataclasses.dataclass(frozen=True)
class ShardedNVFP4Quantizer:
    """``NVFP4Quantizer`` over a shard: the FP32 tensor scale of each layout (and of the
    Hadamard-transformed column-wise layout) comes from the whole tensor's amax, through
    ``reduce``; the 16-element blocks (and 16x16 tiles) are local, the shards being
    multiples of 16. Stochastic rounding's draws are the shard's own."""

    base: NVFP4Quantizer
    reduce: Reduce

    fmt: ClassVar[str] = "e2m1"

    @property
    def scale_blocks(self) -> Blocks:
        return self.base.scale_blocks

    @property
    def pure(self) -> bool:
        return self.base.pure

    def over_shards(self, reduce: Reduce, dim: int) -> ShardedNVFP4Quantizer:
        return dataclasses.replace(self, reduce=reduce)

    def shard_amax(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        return self.base.shard_amax(x, dim)

    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = False,
        generator: torch.Generator | None = None,
    ) -> NVFP4Tensor:
        return self.base.quantize(
            x, rowwise=rowwise, columnwise=columnwise, generator=generator, reduce_amax=self.reduce
        )
