"""Block-scaled FP8: one FP32 scale per 1x128 or 128x128 tile."""

from __future__ import annotations

import math

import torch

from ..formats import ELEMENT_MAX, FP8_DTYPES
from .cast import scale_and_cast, scale_from_amax

TILE = 128  # tile extent along K (and along R for 128x128 tiles)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantize_tiles_reference(
    m: torch.Tensor, tile_rows: int, fmt: str, power_2: bool, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tiles`` in PyTorch operations (the definition the fused operators match)."""
    m = m.contiguous()
    rows, cols = m.shape
    if m.numel() == 0:
        scales = (_ceil_div(rows, tile_rows), _ceil_div(cols, TILE))
        return (
            torch.empty((rows, cols), dtype=FP8_DTYPES[fmt], device=m.device),
            torch.empty(scales, dtype=torch.float32, device=m.device),
        )
    row_cuts = _cuts(rows, tile_rows)
    col_cuts = _cuts(cols, TILE)
    data_rows, scale_rows = [], []
    for r0, r1, tr in row_cuts:
        parts = [
            _quantize_region(m[r0:r1, c0:c1], tr, tk, fmt, power_2, epsilon)
            for c0, c1, tk in col_cuts
        ]
        data_rows.append(_join([d for d, _ in parts], dim=1))
        scale_rows.append(_join([s for _, s in parts], dim=1))
    return _join(data_rows, dim=0).contiguous(), _join(scale_rows, dim=0).reciprocal()


def _cuts(extent: int, tile: int) -> list[tuple[int, int, int]]:
    """``(start, end, tile extent)`` of the full tiles along one dim, then of the partial
    tile at the edge, leaving out empty ones."""
    full = extent - extent % tile
    cuts = [(0, full, tile), (full, extent, extent - full)]
    return [cut for cut in cuts if cut[1] > cut[0]]


def _join(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _quantize_region(
    region: torch.Tensor, tr: int, tk: int, fmt: str, power_2: bool, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 data and FP32 quantization scales of a region made of whole ``tr x tk`` tiles."""
    rows, cols = region.shape
    tiles = region.reshape(rows // tr, tr, cols // tk, tk)
    # max |x| per tile in FP32 (NaN if the tile holds a NaN: scale_from_amax handles it).
    amax = torch.linalg.vector_norm(tiles, ord=math.inf, dim=(1, 3), dtype=torch.float32)
    scale = scale_from_amax(amax, ELEMENT_MAX[fmt], power_2=power_2, epsilon=epsilon)
    data = scale_and_cast(tiles, scale[:, None, :, None], fmt)
    return data.reshape(rows, cols), scale
