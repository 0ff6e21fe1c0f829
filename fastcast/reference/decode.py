"""Dequantization: block scales applied to decoded values, E8M0 scales, E2M1 codes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def apply_scales(
    values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``values`` ``[R, K]`` times its per-block ``scales`` ``[ceil(R/br), ceil(K/bk)]``.

    Each block is scaled through a tiled view ``[R/br, br, K/bk, bk]`` of the values (edge
    tiles zero-padded, the padding sliced off after) that the scales broadcast over,
    rather than by a scale matrix expanded to ``[R, K]``: no ``[R, K]`` temporary in
    eager, and under torch.compile the product stays a loop over tiles. An expanded scale
    is read at ``k // bk``, a division of the column index; Inductor's CPU loop split
    (torch 2.13) fails on a kernel that fuses such a loop with the transposed layout's
    ``[K, R]`` loop over the same input (``AssertionError`` in ``try_loop_split``), as
    dequantizing both layouts of one tensor in one graph does.
    """
    rows, cols = values.shape
    br, bk = block
    # The explicit block-grid shape: reshape(-1, ...) is ambiguous for empty grids.
    grid_rows = 1 if br == 0 else -(-rows // br)
    grid_cols = 1 if bk == 0 else -(-cols // bk)
    # A dimension scaled whole (0) or element by element (1) is not tiled: it broadcasts.
    tile_r, tile_c = max(br, 1), max(bk, 1)
    pad_r = grid_rows * tile_r - rows if tile_r > 1 else 0
    pad_c = grid_cols * tile_c - cols if tile_c > 1 else 0
    padded = F.pad(values, (0, pad_c, 0, pad_r)) if pad_r or pad_c else values
    tiles = padded.reshape((rows + pad_r) // tile_r, tile_r, (cols + pad_c) // tile_c, tile_c)
    out = tiles * scales.reshape(grid_rows, 1, grid_cols, 1)
    out = out.reshape(rows + pad_r, cols + pad_c)
    return out[:rows, :cols] if pad_r or pad_c else out


def decode_e8m0(biased: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes to FP32: ``2**(b - 127)``; 255 is NaN."""
    exp = biased.to(torch.int32) - 127
    values = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)
    return torch.where(biased == 255, torch.full_like(values, math.nan), values)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n/2]`` of two E2M1 codes each to FP32 ``[..., n]``.

    Decoded arithmetically rather than through a value table: a table built per call
    on a CUDA device is a blocking host-to-device copy (a sync per dequantize), and one
    cached per device would outlive the fake tensors of a trace."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    exponent = ((codes >> 1) & 3).float()  # E2M1: sign, 2 exponent bits (bias 1), 1 mantissa
    mantissa = (codes & 1).float() * 0.5
    magnitude = torch.where(exponent == 0, mantissa, (1 + mantissa) * torch.exp2(exponent - 1))
    return torch.where(codes >= 8, -magnitude, magnitude)
