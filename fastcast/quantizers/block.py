"""Block-scaled FP8: one FP32 scale per 1x128 or 128x128 tile of the ``[R, K]`` matrix.

Non-finite values stay non-finite (``BlockScalingQuantizer`` has the details): NaN is NaN,
+-inf is +-inf in E5M2 and NaN in E4M3; the tile holding one falls back to scale 1. Only
finite values beyond the range saturate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from ..formats import FP8_DTYPES
from ..kernels import fused_op
from ..reference.cast import as_matrix
from ..reference.tiles import TILE, quantize_tiles_reference
from ..runtime.observers import attached as _observers
from ..runtime.observers import begin as _begin
from ..runtime.observers import end as _end
from ..tensor import Float8Tensor
from ..token_groups import TokenGroups
from .base import Blocks, check_fp8_format, check_input

TILE_ROWS = {1: 1, 2: TILE}  # block_dim -> tile extent along R


def quantize_tiles(
    m: torch.Tensor, tile_rows: int, fmt: str, power_2: bool, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the matrix ``m`` ``[R, K]`` in tiles of ``tile_rows x 128``.

    Returns the FP8 data ``[R, K]`` (contiguous) and the FP32 dequantization scales
    ``[ceil(R/tile_rows), ceil(K/128)]``. A partial tile at the bottom or right edge is
    scaled from its own elements alone.

    The matrix is cut into at most four regions of whole tiles (the full tiles, the
    partial column of tiles, the partial row, the corner), each quantized through a tile
    view without padding, and the results joined. Zero-padding the edge tiles and slicing
    the padding off again would be shorter, but torch 2.13's Inductor miscompiles that
    pattern on the CPU (the edge tiles' codes come out wrong, silently), and this code
    is also what ``torch.compile`` traces.

    ``m`` may be any strided matrix. The fused operator reads a transposed view (the
    column-wise layout's ``m.t()``) in place; the reference copies it first, so that
    every pass over it reads memory in order.
    """
    op = fused_op("quantize_blocks", m)
    if op is not None:  # amax, scale and cast of every tile in one operator
        return op(m, tile_rows, FP8_DTYPES[fmt], power_2, epsilon)
    return quantize_tiles_reference(m, tile_rows, fmt, power_2, epsilon)


@dataclasses.dataclass(frozen=True)
class BlockScalingQuantizer:
    """FP8 with one FP32 scale per tile. A value object: equal fields, equal quantizers.

    ``block_dim`` 1 scales 1x128 tiles (activations, gradients), 2 scales 128x128 tiles
    (weights). The tensor is viewed as a matrix ``[R, K]`` (leading dims flattened); each
    tile's scale is ``fmt_max / amax(tile)``, rounded down to a power of two when
    ``power_2_scales``, with the amax floored at ``amax_epsilon``; a tile whose amax is 0
    (without epsilon), NaN or infinite gets scale 1 (``scale_from_amax``). Shapes need not
    be multiples of 128: a partial tile at the right or bottom edge is scaled from its own
    elements alone.

    Non-finite values stay non-finite in the data (``scale_and_cast``): +-inf is +-inf in
    E5M2 and NaN in E4M3 (which has no infinity), NaN is NaN, so each dequantizes to a
    non-finite value. Only finite values beyond the range saturate to +-max. A tile
    holding an inf or NaN has scale 1 (the other elements of that tile are scaled by 1);
    every other tile is quantized as if the non-finite value were not there.

    Layouts:

    - row-wise: ``data`` shaped like the input, ``scale_inv`` ``[R, ceil(K/128)]`` (1x128)
      or ``[ceil(R/128), ceil(K/128)]`` (128x128);
    - column-wise: ``data_t`` ``[K, R]``. With 1x128 tiles it is the transposed matrix
      quantized along the other axis (tiles of 128 consecutive rows for each column,
      ``scale_inv_t`` ``[K, ceil(R/128)]``), not a transposition of the row-wise tiles;
      with 128x128 tiles the tiles are the same, so it is exactly the transposed row-wise
      data and scales.
    """

    fmt: str = "e4m3"
    block_dim: int = 1
    power_2_scales: bool = True
    amax_epsilon: float = 0.0

    token_block: ClassVar[int] = TILE  # (quantize_groups: column-wise tiles run along R)

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_fp8_format(name, self.fmt)
        if isinstance(self.block_dim, bool) or self.block_dim not in TILE_ROWS:
            raise ValueError(
                f"{name}: block_dim must be 1 (1x128 tiles) or 2 (128x128 tiles), "
                f"got {self.block_dim!r}"
            )
        if not isinstance(self.power_2_scales, bool):
            raise ValueError(
                f"{name}: power_2_scales must be a bool, got {type(self.power_2_scales).__name__}"
            )
        eps = self.amax_epsilon
        if (
            isinstance(eps, bool)
            or not isinstance(eps, (int, float))
            or not math.isfinite(eps)
            or eps < 0
        ):
            raise ValueError(
                f"{name}: amax_epsilon must be a finite number >= 0, got {self.amax_epsilon!r}"
            )

    pure: ClassVar[bool] = True

    @property
    def block(self) -> tuple[int, int]:
        """The tile shape ``(rows, cols)`` of the row-wise layout."""
        return (TILE_ROWS[self.block_dim], TILE)

    @property
    def scale_blocks(self) -> Blocks:
        return (self.block, self.block)

    def over_shards(self, reduce: Any, dim: int) -> BlockScalingQuantizer:
        return self  # every scale is a tile's: local where shards hold whole tiles

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        opened = _begin("fastcast.quantize.block") if _observers else None  # observer point
        try:
            check_input(x)
            if not (rowwise or columnwise):
                raise ValueError(f"{type(self).__name__}: ask for rowwise and/or columnwise data")
            m = as_matrix(x)
            tile_rows = TILE_ROWS[self.block_dim]
            args = (self.fmt, self.power_2_scales, self.amax_epsilon)
            data = scale_inv = data_t = scale_inv_t = None
            if rowwise or tile_rows == TILE:
                data, scale_inv = quantize_tiles(m, tile_rows, *args)
            if columnwise:
                if tile_rows == TILE:
                    # Square tiles transpose onto themselves.
                    data_t, scale_inv_t = data.t().contiguous(), scale_inv.t().contiguous()
                else:
                    # Tiles run along R: quantize the transposed matrix.
                    data_t, scale_inv_t = quantize_tiles(m.t(), tile_rows, *args)
            return Float8Tensor(
                fmt=self.fmt,
                shape=x.shape,
                dtype=x.dtype,
                data=data.reshape(x.shape) if rowwise else None,
                scale_inv=scale_inv if rowwise else None,
                block=self.block,
                data_t=data_t,
                scale_inv_t=scale_inv_t,
                block_t=self.block,
            )
        finally:
            if opened is not None:
                _end(opened)

    def quantize_groups(
        self, m: torch.Tensor, groups: TokenGroups, *, columnwise: bool = False
    ) -> Float8Tensor | None:
        """``m`` ``[R, D]`` per group of rows (``quantizers.groups``): 1x128 tiles along D
        are each row's own, and along R, from group starts at multiples of 128, each
        group's; None (one ``quantize`` per group) where tiles would span groups."""
        if self.block_dim != 1 or (columnwise and not groups.aligned(TILE)):
            return None
        return self.quantize(m, rowwise=not columnwise, columnwise=columnwise)
