"""MXFP8 and NVFP4 products on Blackwell's block-scaled tensor cores (sm100).

cuBLASLt reads an operand's block scales not row-major but in 128x4 tiles, each tile
stored as 32x4x4 ("SWIZZLE_32_4_4", cuBLAS's "1D block scaling factors layout"): the
scale of row ``r`` and K-block ``c`` of a ``[R, C]`` scale matrix padded to
``round_up(R, 128) x round_up(C, 4)`` sits at

    ((r // 128) * (C4 // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4

``swizzle_32_4_4`` writes that layout from the quantizers' row-major scales, here, per
GEMM (a pad and one permuted copy of the scales, ~1/16 or 1/32 of the data's bytes, on
the device and without a host sync); the quantizers keep their row-major scales, which
the emulation, the CPU and the checkpoints read.

``microscaled_args`` builds what ``torch.nn.functional.scaled_mm`` takes (tests call it
to run torch's meta checks on the exact arguments); ``scaled_mm_microscaled`` runs it.
"""

from __future__ import annotations

from typing import Any

import torch

from .tensor import MXFP8, QuantizedTensor

TILE_ROWS = 128  # rows of one scale tile (four 32-row groups)
TILE_COLS = 4  # K-blocks of one scale tile


def padded_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """``[R, C]`` scales padded to whole 128x4 tiles."""
    return -(-rows // TILE_ROWS) * TILE_ROWS, -(-cols // TILE_COLS) * TILE_COLS


def swizzle_32_4_4(scales: torch.Tensor) -> torch.Tensor:
    """Row-major one-byte scales ``[R, C]`` as cuBLASLt's swizzled block-scale layout: a
    flat tensor of ``round_up(R, 128) * round_up(C, 4)`` elements of the same dtype, the
    padding zero (padded rows and K-blocks lie outside the matrix: never read)."""
    if scales.dim() != 2 or scales.element_size() != 1:
        raise ValueError(
            f"swizzle_32_4_4: needs a 2D tensor of one-byte scales, got {scales.dtype} "
            f"of shape {tuple(scales.shape)}"
        )
    dtype = scales.dtype
    raw = scales.view(torch.uint8)  # (padding and copies of one-byte codes, any dtype)
    rows, cols = raw.shape
    padded_rows, padded_cols = padded_scale_shape(rows, cols)
    if (padded_rows, padded_cols) != (rows, cols):
        raw = torch.nn.functional.pad(raw, (0, padded_cols - cols, 0, padded_rows - rows))
    # [row tile, 4 groups of 32 rows, row in group, K tile, K-block in tile] ->
    # [row tile, K tile, row in group, group, K-block in tile]: 512-byte tiles in
    # row-major tile order, each 32 x (4 x 4).
    tiles = raw.view(padded_rows // TILE_ROWS, 4, 32, padded_cols // TILE_COLS, TILE_COLS)
    flat = tiles.permute(0, 3, 2, 1, 4).reshape(-1)
    return flat.view(dtype)


def _block_scales(q: QuantizedTensor, rows: int) -> torch.Tensor:
    """The operand's scales, one row per data row: ``[R, K / block]``. NVFP4's 16x16
    tiles (``block == (16, 16)``) hold one row per 16 data rows, repeated here."""
    scales = q.scale_inv
    if q.block[0] > 1:
        scales = scales.repeat_interleave(q.block[0], dim=0)
    return scales.reshape(rows, -1)


def _tensor_scale(q: QuantizedTensor) -> torch.Tensor:
    """NVFP4's FP32 tensor decode scale, as the one-element second scale level."""
    return q.global_scale_inv.float().reshape(1)


def microscaled_args(a: QuantizedTensor, b: QuantizedTensor) -> dict[str, Any]:
    """The arguments of ``F.scaled_mm`` for ``a @ b.T`` (both MXFP8, or both NVFP4):
    ``mat_a`` row-major ``[M, K]``, ``mat_b`` the column-major ``b.T`` (NVFP4 as packed
    ``float4_e2m1fn_x2``, ``K / 2`` bytes a row), swizzled block scales (E8M0 for MXFP8;
    E4M3 for NVFP4, with its FP32 tensor scale as a second, tensor-wise level)."""
    functional = torch.nn.functional
    scaling, swizzle = functional.ScalingType, functional.SwizzleType
    a2 = a.data.reshape(-1, a.data.shape[-1]).contiguous()
    b2 = b.data.contiguous()
    rows_a, rows_b = a2.shape[0], b2.shape[0]
    if a.family == MXFP8:
        e8m0 = torch.float8_e8m0fnu
        scale_a = [swizzle_32_4_4(_block_scales(a, rows_a)).view(e8m0)]
        scale_b = [swizzle_32_4_4(_block_scales(b, rows_b)).view(e8m0)]
        recipe = [scaling.BlockWise1x32]
    else:  # NVFP4: E4M3 block scales, then the FP32 tensor scale
        fp4 = torch.float4_e2m1fn_x2
        a2, b2 = a2.view(fp4), b2.view(fp4)
        scale_a = [swizzle_32_4_4(_block_scales(a, rows_a)), _tensor_scale(a)]
        scale_b = [swizzle_32_4_4(_block_scales(b, rows_b)), _tensor_scale(b)]
        recipe = [scaling.BlockWise1x16, scaling.TensorWise]
    swizzles = [swizzle.SWIZZLE_32_4_4] + [swizzle.NO_SWIZZLE] * (len(recipe) - 1)
    return {
        "mat_a": a2,
        "mat_b": b2.t(),
        "scale_a": scale_a,
        "scale_recipe_a": recipe,
        "scale_b": scale_b,
        "scale_recipe_b": recipe,
        "swizzle_a": swizzles,
        "swizzle_b": swizzles,
    }


def scaled_mm_microscaled(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``a @ b.T`` ``[M, N]`` in ``out_dtype`` on the block-scaled kernel (no bias: the
    caller adds one, or emulates)."""
    return torch.nn.functional.scaled_mm(**microscaled_args(a, b), output_dtype=out_dtype)
