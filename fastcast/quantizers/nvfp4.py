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
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..kernels import fused_op
from ..reference import hadamard
from ..reference.cast import as_matrix, scale_from_amax
from ..reference.nvfp4 import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    encode_blocks,
    global_amax,
    pack_e2m1,
    quantize_reference,
)
from ..runtime.observers import attached as _observers
from ..runtime.observers import begin as _begin
from ..runtime.observers import end as _end
from ..tensor import NVFP4Tensor
from ..token_groups import TokenGroups
from .base import Blocks, check_input
from .sharded import ShardedNVFP4Quantizer


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
    token_block: ClassVar[int] = BLOCK  # (quantize_groups: column-wise blocks along R)

    def __post_init__(self) -> None:
        for name in ("block_2d", "stochastic_rounding", "rht_round_to_input_dtype"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"NVFP4Quantizer: {name} must be a bool, got {value!r}")
        if self.rht is not None:
            hadamard.check_signs(self.rht)
            if self.block_2d:
                raise ValueError(
                    "NVFP4Quantizer: rht transforms the 1x16 column-wise layout; 16x16 tiles "
                    "(block_2d=True) share one quantization between the layouts"
                )
            object.__setattr__(self, "rht", tuple(self.rht))

    @property
    def scale_blocks(self) -> Blocks:
        block = (BLOCK if self.block_2d else 1, BLOCK)
        return (block, block)

    @property
    def pure(self) -> bool:
        return not self.stochastic_rounding

    def over_shards(self, reduce: Any, dim: int) -> Any:
        """The blocks are local; the FP32 tensor scale spans every shard."""
        return ShardedNVFP4Quantizer(self, reduce)

    def shard_amax(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        if self.rht is not None:  # two tensor scales: the quantize reduces them itself
            return None
        return global_amax(as_matrix(x).float().abs())

    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = False,
        generator: torch.Generator | None = None,
        reduce_amax: Callable[[torch.Tensor], Any] | None = None,
    ) -> NVFP4Tensor:
        """``reduce_amax`` max-reduces each tensor scale's amax in place (a shard of a
        tensor split across ranks gets the whole tensor's scale); it runs the reference,
        as the fused operator computes the tensor scale inside."""
        opened = _begin("fastcast.quantize.nvfp4") if _observers else None  # observer point
        try:
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
                return self._quantize_transformed(x, matrix, rowwise, generator, reduce_amax)
            return self._quantize(x, matrix, rowwise, columnwise, generator, reduce_amax)
        finally:
            if opened is not None:
                _end(opened)

    def _quantize_transformed(
        self,
        x: torch.Tensor,
        matrix: torch.Tensor,
        rowwise: bool,
        generator: torch.Generator | None,
        reduce_amax: Callable[[torch.Tensor], Any] | None,
    ) -> NVFP4Tensor:
        """The row-wise layout of ``x`` and the column-wise layout of its transform, each
        under its own tensor scale (TE's post-RHT amax): two quantizations, in this order
        (the stochastic draws of each are those of the plain layouts)."""
        assert self.rht is not None
        row = self._quantize(x, matrix, True, False, generator, reduce_amax) if rowwise else None
        transformed = hadamard.transform_columns(matrix, self.rht)
        if self.rht_round_to_input_dtype and x.dtype != transformed.dtype:
            transformed = transformed.to(x.dtype)  # TE's rounding (FP32 sums, one rounding)
        col = self._quantize(transformed, transformed, False, True, generator, reduce_amax)
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
        reduce_amax: Callable[[torch.Tensor], Any] | None = None,
    ) -> NVFP4Tensor:
        """``quantize`` without the transform (shapes checked)."""
        rows, cols = matrix.shape
        rand = rand_t = None
        if self.stochastic_rounding:
            rand, rand_t = _draws(x, rows, cols, self.block_2d, rowwise, columnwise, generator)
        args = (x, self.block_2d, rowwise, columnwise, self.stochastic_rounding, rand, rand_t)
        if reduce_amax is not None:
            results = quantize_reference(*args, reduce_amax)
        else:
            op = fused_op("quantize_nvfp4", x)
            results = (quantize_reference if op is None else op)(*args)  # one operator
        data, scale_inv, data_t, scale_inv_t, global_scale_inv = results
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

    def quantize_groups(
        self, m: torch.Tensor, groups: TokenGroups, *, columnwise: bool = False
    ) -> NVFP4Tensor | None:
        """``m`` ``[R, D]`` per group of rows (``quantizers.groups``): each group's tensor
        scale from its own amax (held per row, or per block along R), blocks along D each
        row's own, along R (from group starts at multiples of 16, after the Hadamard
        transform with ``rht``) each group's; None (one ``quantize`` per group) for 16x16
        tiles, or blocks that would span groups. The transformed layout is returned as it
        is (``rht_t`` names the transform; the GEMM of two transformed operands is the
        product of the matrices)."""
        if self.block_2d or (columnwise and not groups.aligned(BLOCK)):
            return None
        rows, cols = m.shape
        v = m.float()
        if columnwise and self.rht is not None:
            v = hadamard.transform_columns(m, self.rht)
            if self.rht_round_to_input_dtype and m.dtype != v.dtype:
                v = v.to(m.dtype).float()
        finite = v.abs().nan_to_num_(nan=0.0, posinf=0.0)
        s_enc = scale_from_amax(groups.amax(finite.amax(dim=1)), E2M1_MAX * E4M3_MAX)
        if columnwise:  # [D, R]: blocks of 16 rows, each inside one group
            blocks = v.t().contiguous().reshape(cols, 1, rows // BLOCK, BLOCK)
            s_enc = s_enc[groups.ids[::BLOCK]].unsqueeze(0)
        else:
            blocks = v.reshape(rows, 1, cols // BLOCK, BLOCK)
            s_enc = s_enc[groups.ids].unsqueeze(1)
        mag = blocks.abs()
        draw = torch.rand(blocks.shape, device=m.device) if self.stochastic_rounding else None
        codes, s_dec = encode_blocks(blocks, mag, mag.amax(dim=(1, 3)), s_enc, draw)
        data = pack_e2m1(codes.reshape(blocks.shape[0], -1))
        layout = (None, None, data, s_dec) if columnwise else (data, s_dec, None, None)
        return NVFP4Tensor(
            fmt=self.fmt,
            shape=m.shape,
            dtype=m.dtype,
            data=layout[0],
            scale_inv=layout[1],
            block=(1, BLOCK),
            data_t=layout[2],
            scale_inv_t=layout[3],
            block_t=(1, BLOCK),
            global_scale_inv=s_enc.reciprocal(),
            rht_t=self.rht if columnwise else None,
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
