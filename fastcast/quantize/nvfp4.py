"""NVFP4: E2M1 elements in blocks of 16 with E4M3 block scales and an FP32 tensor scale.

The two-level scaling NVIDIA defines for Blackwell, with ``amax`` the max magnitude of
the tensor's finite elements and ``amax_b`` that of one block (all arithmetic in FP32,
each step written as TransformerEngine's reference quantizer computes it, so that the
codes agree with it bit for bit, near-ties included):

- tensor encode scale ``s_enc = (6 * 448) / amax`` (amax 0: 1.0; an amax below
  ``6 * 448 / FP32_MAX`` counts as that), stored as its reciprocal, the tensor decode
  scale ``global_scale_inv = 1 / s_enc``;
- block decode scale ``s_dec = amax_b * (s_enc * (1/6))`` (TE's
  ``vec_max * global_encode_scale_multiplier``, with ``1/6`` rounded to FP32), stored as
  E4M3 with a saturating cast, so the largest block of the tensor gets (about) 448;
- elements ``v = x * (1 / (s_dec * global_scale_inv))`` (TE's
  ``1 / (decode_scale * global_decode_scale)``: the multiplier consistent with what the
  decoder multiplies by), computed once per block from the stored E4M3 ``s_dec`` and
  clamped to the FP32 max (a block whose ``s_dec`` is 0 encodes as zeros; TE gives it
  codes of +-6, which decode to 0 as well), rounded to E2M1
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``: to nearest, ties to the even code (the one whose
  mantissa bit is 0), saturating at 6, the sign of ``x`` in bit 3 (a negative value
  rounding to zero gives -0; -0.0 itself encodes as +0); or, with stochastic rounding,
  to one of the two neighbouring grid values with probability proportional to proximity;
- decoding: ``x ~= e2m1 * s_dec * global_scale_inv`` (``NVFP4Tensor``).

Blocks are 16 consecutive elements along K (``1x16``), or 16x16 tiles, whose
column-wise layout is then the exact transpose of the row-wise one (a weight and its
transpose share one quantization). The 1x16 column-wise layout quantizes ``x.t()``
along R with the same tensor scale; with ``rht`` (the random Hadamard transform of the
weight-gradient operands, ``quantize.hadamard``) it quantizes ``RHT(x).t()``
instead, under a tensor scale of its own (the transform changes the amax), kept in
``global_scale_inv_t``.

Non-finite inputs: E2M1 has neither NaN nor infinity, and the E4M3 block scale has no
infinity. A block holding a NaN or an infinity gets a NaN E4M3 scale (its amax is not
finite, and the scale cast turns inf into NaN rather than saturating it) and codes of
+-0, so that whole block, not only the non-finite element, dequantizes to NaN. The
tensor amax leaves non-finite elements out, so every other block quantizes exactly as
it would were those elements 0 (only a tensor with no finite non-zero element falls
back to ``s_enc = 1``). Only finite values beyond the range saturate: elements at the
code for 6, block scales at 448.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..formats import E2M1_VALUES, ELEMENT_MAX, FP32_MAX
from ..kernels import fused_op
from ..profiling import annotate
from ..reference.cast import as_matrix, scale_and_cast, scale_from_amax
from ..tensor import NVFP4Tensor
from . import hadamard
from .base import check_input

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


def _global_encode_scale(mag: torch.Tensor) -> torch.Tensor:
    """``s_enc = 6 * 448 / amax`` as an FP32 scalar, ``amax`` the max of the finite
    magnitudes ``mag`` (1.0 when there is none above 0).

    Non-finite elements are left out rather than let a NaN amax reset the scale to 1.0:
    under that fallback the blocks of small values would flush to zero, so one NaN
    would wipe out the whole tensor instead of its own block."""
    if mag.numel() == 0:
        amax = torch.zeros((), dtype=torch.float32, device=mag.device)
    else:
        amax = torch.nan_to_num(mag, nan=0.0, posinf=0.0).amax()
    return scale_from_amax(amax, E2M1_MAX * E4M3_MAX)


def _encode(
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


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[n, m]`` to ``[n, m/2]`` bytes, the first of each pair in the low nibble."""
    pairs = codes.reshape(codes.shape[0], codes.shape[1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _tiles(matrix: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[rows, cols]`` as ``[rows/tr, tr, cols/16, 16]`` tiles, their magnitudes and amaxes."""
    rows, cols = matrix.shape
    blocks = matrix.reshape(rows // tile_rows, tile_rows, cols // BLOCK, BLOCK)
    mag = blocks.abs()
    return blocks, mag, mag.amax(dim=(1, 3))


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer:
    """NVFP4 quantization (see the module docstring). A value object.

    ``block_2d``: 16x16 tiles instead of 1x16 blocks (weights). ``stochastic_rounding``:
    round elements stochastically (gradients), drawing from ``generator`` when given.
    ``rht``: the sign vector of a random Hadamard transform (``hadamard.sign_vector``)
    applied along R to the column-wise layout before it is quantized, under a tensor
    scale of its own (the weight-gradient operands, input and gradient, whose product
    the transform leaves unchanged); the row-wise layout stays as it is. 1x16 only.
    ``rht_round_to_input_dtype``: round the transformed values to the input's dtype
    (bf16, fp16) before quantizing them, as TransformerEngine does (its transform runs
    in the input's dtype), so that codes and the transformed layout's tensor scale equal
    TE's bit for bit; by default they stay FP32, closer to exact arithmetic.
    """

    block_2d: bool = False
    stochastic_rounding: bool = False
    rht: tuple[int, ...] | None = None
    rht_round_to_input_dtype: bool = False

    fmt: ClassVar[str] = "e2m1"

    def __post_init__(self) -> None:
        for name in ("block_2d", "stochastic_rounding", "rht_round_to_input_dtype"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"NVFP4Quantizer: {name} must be a bool, got {value!r}")
        if self.rht is not None:
            hadamard.rht_matrix(self.rht)  # checks the signs
            if self.block_2d:
                raise ValueError(
                    "NVFP4Quantizer: rht transforms the 1x16 column-wise layout; 16x16 tiles "
                    "(block_2d=True) share one quantization between the layouts"
                )
            object.__setattr__(self, "rht", tuple(self.rht))

    @annotate("fastcast.quantize.nvfp4")
    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = False,
        generator: torch.Generator | None = None,
    ) -> NVFP4Tensor:
        check_input(x)
        if not (rowwise or columnwise):
            raise ValueError("NVFP4Quantizer: ask for rowwise and/or columnwise data")
        matrix = as_matrix(x)
        rows, cols = matrix.shape
        if cols % BLOCK:
            # K alone: the rows may be fc.Linear's padding of the tokens, not the caller's.
            raise ValueError(
                f"NVFP4 needs the last dimension (K={cols}) to be a multiple of {BLOCK}"
            )
        if (self.block_2d or columnwise) and rows % BLOCK:
            why = "16x16 tiles" if self.block_2d else "a column-wise layout"
            raise ValueError(
                f"NVFP4 with {why} needs the number of rows (R={rows}, the product of all "
                f"but the last dimension) to be a multiple of {BLOCK}; got a tensor of "
                f"shape {tuple(x.shape)}"
            )
        if self.rht is not None and columnwise:
            return self._quantize_transformed(x, matrix, rowwise, generator)
        return self._quantize(x, matrix, rowwise, columnwise, generator)

    def _quantize_transformed(
        self,
        x: torch.Tensor,
        matrix: torch.Tensor,
        rowwise: bool,
        generator: torch.Generator | None,
    ) -> NVFP4Tensor:
        """The row-wise layout of ``x`` and the column-wise layout of its transform, each
        under its own tensor scale (TE's post-RHT amax): two quantizations, in this order
        (the stochastic draws of each are those of the plain layouts)."""
        assert self.rht is not None
        row = self._quantize(x, matrix, True, False, generator) if rowwise else None
        transformed = hadamard.transform_columns(matrix, self.rht)
        if self.rht_round_to_input_dtype and x.dtype != transformed.dtype:
            transformed = transformed.to(x.dtype)  # TE's rounding (FP32 sums, one rounding)
        col = self._quantize(transformed, transformed, False, True, generator)
        return NVFP4Tensor(
            fmt=self.fmt,
            shape=x.shape,
            dtype=x.dtype,
            data=None if row is None else row.data,
            scale_inv=None if row is None else row.scale_inv,
            block=col.block,
            data_t=col.data_t,
            scale_inv_t=col.scale_inv_t,
            block_t=col.block_t,
            global_scale_inv=col.global_scale_inv if row is None else row.global_scale_inv,
            global_scale_inv_t=col.global_scale_inv,
            rht_t=self.rht,
        )

    def _quantize(
        self,
        x: torch.Tensor,
        matrix: torch.Tensor,
        rowwise: bool,
        columnwise: bool,
        generator: torch.Generator | None,
    ) -> NVFP4Tensor:
        """``quantize`` without the transform (shapes checked)."""
        rows, cols = matrix.shape
        rand = rand_t = None
        if self.stochastic_rounding:
            rand, rand_t = _draws(x, rows, cols, self.block_2d, rowwise, columnwise, generator)
        op = fused_op("quantize_nvfp4", x)
        quantize = quantize_reference if op is None else op  # both passes in one operator
        data, scale_inv, data_t, scale_inv_t, global_scale_inv = quantize(
            x, self.block_2d, rowwise, columnwise, self.stochastic_rounding, rand, rand_t
        )
        block = (BLOCK if self.block_2d else 1, BLOCK)
        return NVFP4Tensor(
            fmt=self.fmt,
            shape=x.shape,
            dtype=x.dtype,
            data=data.reshape(*x.shape[:-1], cols // 2) if rowwise else None,
            scale_inv=scale_inv if rowwise else None,
            block=block,
            data_t=data_t if columnwise else None,
            scale_inv_t=scale_inv_t if columnwise else None,
            block_t=block,
            global_scale_inv=global_scale_inv,
        )


def _draws(
    x: torch.Tensor,
    rows: int,
    cols: int,
    block_2d: bool,
    rowwise: bool,
    columnwise: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Stochastic rounding's numbers, drawn before the quantize (so that the fused and
    compiled operators take them as inputs and match the reference bit for bit): those of
    the row-wise codes (16x16: both layouts'), laid out like ``x`` ``[R, K]``, then those
    of the 1x16 column-wise codes ``[K, R]``, each only where those codes are computed."""
    draw = dict(generator=generator, dtype=torch.float32, device=x.device)
    rand = torch.rand((rows, cols), **draw) if rowwise or block_2d else None
    rand_t = torch.rand((cols, rows), **draw) if columnwise and not block_2d else None
    return rand, rand_t


def quantize_reference(
    x: torch.Tensor,
    block_2d: bool,
    rowwise: bool,
    columnwise: bool,
    stochastic: bool,
    rand: torch.Tensor | None,
    rand_t: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of ``x`` in PyTorch operations (the definition the fused operators match),
    with their signature and results (``kernels/fake.py``): data ``[R, K/2]``, scale_inv,
    data_t ``[K, R/2]``, scale_inv_t (each with 0 rows where its layout was not asked
    for) and global_scale_inv. ``rand``, ``rand_t``: stochastic rounding's numbers
    (``_draws``)."""
    matrix = as_matrix(x).float()
    rows, cols = matrix.shape
    tile_rows = BLOCK if block_2d else 1
    data = scale_inv = data_t = scale_inv_t = s_enc = None
    if rowwise or block_2d:
        blocks, mag, amax = _tiles(matrix, tile_rows)
        s_enc = _global_encode_scale(mag)
        codes, scales = _encode(blocks, mag, amax, s_enc, rand if stochastic else None)
        codes = codes.reshape(rows, cols)
        if rowwise:
            data, scale_inv = _pack(codes), scales
    if columnwise:
        if block_2d:
            # The same tiles, transposed: codes and scales move, nothing is re-rounded.
            data_t, scale_inv_t = _pack(codes.t()), scales.t().contiguous()
        else:
            blocks, mag, amax = _tiles(matrix.t(), 1)
            if s_enc is None:
                s_enc = _global_encode_scale(mag)
            draw = rand_t if stochastic else None
            codes_t, scale_inv_t = _encode(blocks, mag, amax, s_enc, draw)
            data_t = _pack(codes_t.reshape(cols, rows))
    # The layouts not asked for, as the operators return them: no rows.
    blocks_k, strips = cols // BLOCK, rows // BLOCK
    if data is None:
        data = matrix.new_empty((0, cols // 2), dtype=torch.uint8)
        scale_inv = matrix.new_empty((0, blocks_k), dtype=torch.float8_e4m3fn)
    if data_t is None:
        data_t = matrix.new_empty((0, rows // 2), dtype=torch.uint8)
        scale_inv_t = matrix.new_empty((0, strips), dtype=torch.float8_e4m3fn)
    return data, scale_inv, data_t, scale_inv_t, s_enc.reciprocal()
