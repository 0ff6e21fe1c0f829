"""NVFP4: E2M1 elements in 16-element blocks with E4M3 block scales and an FP32 tensor
scale, as TransformerEngine's reference computes them (``fastcast.quantizers.nvfp4`` has
the arithmetic written out)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..formats import E2M1_VALUES, ELEMENT_MAX, FP32_MAX
from .cast import as_matrix, scale_and_cast, scale_from_amax

BLOCK = 16


E2M1_MAX = ELEMENT_MAX["e2m1"]


E4M3_MAX = ELEMENT_MAX["e4m3"]


_ONE_SIXTH = torch.tensor(1.0, dtype=torch.float32).div(E2M1_MAX).item()  # 1/6 in FP32


# Round to nearest: a magnitude above the midpoint between two neighbouring grid values
# moves up a code; at the midpoint itself it moves up only when the upper code is even
# (0.75 -> 1, 1.75 -> 2, 3.5 -> 4; but 0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4).
_MIDPOINTS: tuple[tuple[float, bool], ...] = tuple(
    (
        (E2M1_VALUES[code] + E2M1_VALUES[code + 1]) / 2,
        (code + 1) % 2 == 0,  # whether a tie rounds up
    )
    for code in range(len(E2M1_VALUES) - 1)
)


def _round_nearest_even(mag: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude codes (uint8 0..7) of non-negative values; NaN gives 0."""
    codes = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    above = torch.empty(mag.shape, dtype=torch.bool, device=mag.device)
    for midpoint, tie_up in _MIDPOINTS:
        (torch.ge if tie_up else torch.gt)(mag, midpoint, out=above)
        codes += above
    return codes


def _round_stochastic(mag: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude codes, rounding up with probability (mag - lower) / step; NaN gives 0.

    ``draw`` holds one uniform [0, 1) FP32 number per element, in ``mag``'s order.
    Exact in FP32: the grid spacing is 0.5 below 2, 1 below 4 and 2 up to 6, all powers of
    two. A value on the grid has probability 0 of moving, and so has one clamped to 6.
    """
    clamped = mag.clamp(max=E2M1_MAX)
    step = torch.where(clamped >= 4.0, 2.0, torch.where(clamped >= 2.0, 1.0, 0.5))
    units = clamped.div_(step)  # the value in steps of its binade
    lower = units.floor()
    units -= lower  # the fraction of a step above the grid value below
    lower += draw.reshape(mag.shape) < units
    # Every value is now on the grid, where rounding to nearest is the identity.
    return _round_nearest_even(lower.mul_(step))


def global_amax(mag: torch.Tensor) -> torch.Tensor:
    """The tensor amax of NVFP4's tensor scale: the max of the finite magnitudes ``mag``
    (FP32), 0 when there is none."""
    if mag.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=mag.device)
    return torch.nan_to_num(mag, nan=0.0, posinf=0.0).amax()


def global_encode_scale(
    mag: torch.Tensor, reduce_amax: Callable[[torch.Tensor], Any] | None = None
) -> torch.Tensor:
    """``s_enc = 6 * 448 / amax`` as an FP32 scalar, ``amax`` the max of the finite
    magnitudes ``mag`` (1.0 when there is none above 0). ``reduce_amax`` max-reduces the
    amax in place first (a tensor-parallel shard: the whole tensor's scale).

    Non-finite elements are left out rather than let a NaN amax reset the scale to 1.0:
    under that fallback the blocks of small values would flush to zero, so one NaN
    would wipe out the whole tensor instead of its own block."""
    amax = global_amax(mag)
    if reduce_amax is not None:
        reduce_amax(amax)
    return scale_from_amax(amax, E2M1_MAX * E4M3_MAX)


def encode_blocks(
    blocks: torch.Tensor,
    mag: torch.Tensor,
    block_amax: torch.Tensor,
    s_enc: torch.Tensor,
    draw: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed E2M1 codes (uint8, shaped like ``blocks``) and E4M3 block scales.

    ``blocks`` is ``[rows/tr, tr, cols/16, 16]`` (FP32), ``mag`` its magnitudes (a
    temporary, overwritten) and ``block_amax`` its per-tile max ``[rows/tr, cols/16]``;
    ``draw``: stochastic rounding's numbers, in ``blocks``' order (None: to nearest).
    """
    # TE's formulas (see the module docstring), FP32 step by step: the block scale
    # amax_b * (s_enc * (1/6)) and the multiplier 1 / (s_dec * (1/s_enc)). Equivalent in
    # exact arithmetic to amax_b / 6 * s_enc and s_enc / s_dec, they round differently:
    # a few codes in 8192 of a random bf16 tensor sit at near-ties where the two disagree.
    s_dec = scale_and_cast(block_amax, s_enc * _ONE_SIXTH, "e4m3")
    s_dec_f32 = s_dec.float()
    s_dec_global = s_enc.reciprocal()
    # The per-block encode multiplier; a zero decode scale means the block encodes as 0.
    encode = torch.where(
        s_dec_f32 == 0, 0.0, s_dec_f32.mul_(s_dec_global).reciprocal_().clamp_max_(FP32_MAX)
    )
    scaled = mag.mul_(encode[:, None, :, None])
    if draw is not None:
        codes = _round_stochastic(scaled, draw)
    else:
        codes = _round_nearest_even(scaled)
    codes.add_(blocks < 0, alpha=8)  # the sign bit; NaN and -0.0 compare False: code +0
    return codes, s_dec


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[n, m]`` to ``[n, m/2]`` bytes, the first of each pair in the low nibble."""
    pairs = codes.reshape(codes.shape[0], codes.shape[1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def tile_blocks(
    matrix: torch.Tensor, tile_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[rows, cols]`` as ``[rows/tr, tr, cols/16, 16]`` tiles, their magnitudes and amaxes."""
    rows, cols = matrix.shape
    blocks = matrix.reshape(rows // tile_rows, tile_rows, cols // BLOCK, BLOCK)
    mag = blocks.abs()
    return blocks, mag, mag.amax(dim=(1, 3))


def quantize_reference(
    x: torch.Tensor,
    block_2d: bool,
    rowwise: bool,
    columnwise: bool,
    stochastic: bool,
    rand: torch.Tensor | None,
    rand_t: torch.Tensor | None,
    reduce_amax: Callable[[torch.Tensor], Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of ``x`` in PyTorch operations (the definition the fused operators match),
    with their signature and results (``kernels/fake.py``): data ``[R, K/2]``, scale_inv,
    data_t ``[K, R/2]``, scale_inv_t (each with 0 rows where its layout was not asked
    for) and global_scale_inv. ``rand``, ``rand_t``: stochastic rounding's numbers
    (``_draws``). ``reduce_amax``: see ``global_encode_scale`` (no operator takes it)."""
    matrix = as_matrix(x).float()
    rows, cols = matrix.shape
    tile_rows = BLOCK if block_2d else 1
    data = scale_inv = data_t = scale_inv_t = s_enc = None
    if rowwise or block_2d:
        blocks, mag, amax = tile_blocks(matrix, tile_rows)
        s_enc = global_encode_scale(mag, reduce_amax)
        codes, scales = encode_blocks(blocks, mag, amax, s_enc, rand if stochastic else None)
        codes = codes.reshape(rows, cols)
        if rowwise:
            data, scale_inv = pack_e2m1(codes), scales
    if columnwise:
        if block_2d:
            # The same tiles, transposed: codes and scales move, nothing is re-rounded.
            data_t, scale_inv_t = pack_e2m1(codes.t()), scales.t().contiguous()
        else:
            blocks, mag, amax = tile_blocks(matrix.t(), 1)
            if s_enc is None:
                s_enc = global_encode_scale(mag, reduce_amax)
            draw = rand_t if stochastic else None
            codes_t, scale_inv_t = encode_blocks(blocks, mag, amax, s_enc, draw)
            data_t = pack_e2m1(codes_t.reshape(cols, rows))
    # The layouts not asked for, as the operators return them: no rows.
    blocks_k, strips = cols // BLOCK, rows // BLOCK
    if data is None:
        data = matrix.new_empty((0, cols // 2), dtype=torch.uint8)
        scale_inv = matrix.new_empty((0, blocks_k), dtype=torch.float8_e4m3fn)
    if data_t is None:
        data_t = matrix.new_empty((0, rows // 2), dtype=torch.uint8)
        scale_inv_t = matrix.new_empty((0, strips), dtype=torch.float8_e4m3fn)
    return data, scale_inv, data_t, scale_inv_t, s_enc.reciprocal()
