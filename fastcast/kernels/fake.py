"""Fake (meta) implementations of the C++ operators: shapes and dtypes, no data.

``torch.compile`` traces the reference instead of these operators, but a graph that
holds one (``torch.library.opcheck``, export of an eager-captured graph) needs them.
Imported once the library is loaded, since they attach to its schemas.
"""

from __future__ import annotations

import math

import torch


@torch.library.register_fake("fastcast_kernels::quantize_tensorwise")
def _quantize_tensorwise(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    power_2: bool,
    epsilon: float,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cols = x.shape[-1]
    rows = math.prod(x.shape[:-1])  # x viewed as [R, K]
    data = x.new_empty(x.shape if rowwise else (0,), dtype=dtype)
    data_t = x.new_empty((cols, rows) if columnwise else (0,), dtype=dtype)
    if scale is None:
        scale_inv = x.new_empty((), dtype=torch.float32)
    else:
        scale_inv = scale.new_empty(scale.shape)
    return data, scale_inv, data_t


@torch.library.register_fake("fastcast_kernels::record_amax")
def _record_amax(slot: torch.Tensor, x: torch.Tensor) -> None:
    return None


@torch.library.register_fake("fastcast_kernels::delayed_update")
def _delayed_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    target: float,
    floor: float,
    min_scale: float,
    most_recent: bool,
) -> None:
    return None


@torch.library.register_fake("fastcast_kernels::quantize_recording")
def _quantize_recording(
    x: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=dtype), scale.new_empty(scale.shape)


@torch.library.register_fake("fastcast_kernels::scaled_mm_tensorwise")
def _scaled_mm_tensorwise(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.register_fake("fastcast_kernels::quantize_nvfp4")
def _quantize_nvfp4(
    x: torch.Tensor,
    block_2d: bool,
    rowwise: bool,
    columnwise: bool,
    stochastic: bool,
    rand: torch.Tensor | None,
    rand_t: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cols = x.shape[-1]
    rows = math.prod(x.shape[:-1])  # x viewed as [R, K], in blocks of 16 along K
    blocks, strips = cols // 16, rows // 16
    scale_rows = strips if block_2d else rows
    scale_t_rows = blocks if block_2d else cols
    codes, e4m3 = torch.uint8, torch.float8_e4m3fn
    return (
        x.new_empty((rows if rowwise else 0, cols // 2), dtype=codes),
        x.new_empty((scale_rows if rowwise else 0, blocks), dtype=e4m3),
        x.new_empty((cols if columnwise else 0, rows // 2), dtype=codes),
        x.new_empty((scale_t_rows if columnwise else 0, strips), dtype=e4m3),
        x.new_empty((), dtype=torch.float32),
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@torch.library.register_fake("fastcast_kernels::quantize_blocks")
def _quantize_blocks(
    m: torch.Tensor, tile_rows: int, dtype: torch.dtype, power_2: bool, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = m.shape
    scales = (_ceil_div(rows, tile_rows), _ceil_div(cols, 128))
    return m.new_empty((rows, cols), dtype=dtype), m.new_empty(scales, dtype=torch.float32)


@torch.library.register_fake("fastcast_kernels::quantize_rows")
def _quantize_rows(
    m: torch.Tensor, dtype: torch.dtype, power_2: bool, columns: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = m.shape
    scales = (1, cols) if columns else (rows, 1)
    return m.new_empty((rows, cols), dtype=dtype), m.new_empty(scales, dtype=torch.float32)


@torch.library.register_fake("fastcast_kernels::quantize_mxfp8")
def _quantize_mxfp8(
    m: torch.Tensor, dtype: torch.dtype, ocp: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = m.shape
    return m.new_empty((rows, cols), dtype=dtype), m.new_empty(
        (rows, cols // 32), dtype=torch.uint8
    )


@torch.library.register_fake("fastcast_kernels::dequantize_blocks")
def _dequantize_blocks(
    data: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int
) -> torch.Tensor:
    return data.new_empty(data.shape, dtype=torch.float32)


@torch.library.register_fake("fastcast_kernels::dequantize_nvfp4")
def _dequantize_nvfp4(
    data: torch.Tensor, scales: torch.Tensor, global_scale_inv: torch.Tensor, block_rows: int
) -> torch.Tensor:
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=torch.float32)
