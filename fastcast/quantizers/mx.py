"""MXFP8 (OCP Microscaling v1.0): 32 consecutive elements share one E8M0 scale.

Non-finite values stay non-finite (``MXFP8Quantizer`` has the details): NaN is NaN, +-inf
is +-inf in E5M2 and NaN in E4M3; they are left out of their block's amax, so the rest of
the block keeps its precision. Only finite values beyond the element max saturate.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from ..formats import FP8_DTYPES
from ..kernels import fused_op
from ..reference.cast import as_matrix
from ..reference.mx import MX_BLOCK, quantize_blocks_reference
from ..runtime.observers import attached as _observers
from ..runtime.observers import begin as _begin
from ..runtime.observers import end as _end
from ..tensor import MXFP8Tensor
from ..token_groups import TokenGroups
from .base import Blocks, check_fp8_format, check_input

SCALE_RULES = ("rceil", "ocp")


def quantize_blocks(m: torch.Tensor, fmt: str, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``m`` ``[R, K]`` (K a multiple of 32) in 1x32 blocks.

    Returns FP8 data ``[R, K]`` (contiguous) and E8M0 bytes ``[R, K/32]`` (uint8).

    ``m`` may be any strided matrix. The fused operator reads a transposed view (the
    column-wise layout's ``m.t()``) in place; the reference copies it first, so that
    every pass over it reads memory in order.
    """
    op = fused_op("quantize_mxfp8", m)
    if op is not None:  # amax, exponent and cast of every block in one operator
        return op(m, FP8_DTYPES[fmt], rule == "ocp")
    return quantize_blocks_reference(m, fmt, rule)


@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer:
    """MXFP8: FP8 elements with one E8M0 scale (power of two) per 32 consecutive elements.

    A value object: equal fields, equal quantizers. The tensor is viewed as a matrix
    ``[R, K]`` (leading dims flattened); K must be a multiple of 32, and so must R when
    the column-wise layout is requested.

    The shared exponent X of a block follows ``scale_rule``:

    - ``"ocp"`` (OCP MX spec v1.0, section 6.3): ``X = floor(log2(amax)) - emax_elem``,
      emax_elem being 8 for E4M3 and 15 for E5M2. Elements ``x / 2**X`` may exceed the
      element max (up to almost twice it) and saturate to it.
    - ``"rceil"`` (cuBLAS / TransformerEngine): ``X = ceil(log2(amax / fmt_max))``, the
      smallest power of two with ``amax / 2**X <= fmt_max``, so nothing saturates.

    Both compute X exactly from the bits of the amax, clamp it to ``[-127, 127 - emax_elem]``
    and store the byte ``X + 127`` (255, NaN, is never produced). Finite elements beyond
    the element max saturate to it. The upper bound keeps every code's dequantized value
    finite; ``rceil`` meets it only for an amax above ``fmt_max * 2**(127 - emax_elem)``
    (FP32's top binade), where it takes ``ocp``'s X and the largest elements saturate.

    Non-finite elements are left out of the amax, so the other elements of their block get
    the X they would get if it were a zero (a block that is all zeros or all NaN gets
    X = -127), and the non-finite elements stay non-finite in the data: NaN stays NaN,
    +-inf stays +-inf in E5M2 and becomes NaN in E4M3, which has no infinity. Each
    dequantizes to a non-finite value.

    Layouts: row-wise ``data`` shaped like the input with ``scale_inv`` ``[R, K/32]``;
    column-wise ``data_t`` ``[K, R]`` is the transposed matrix quantized along R, with its
    own scales ``scale_inv_t`` ``[K, R/32]``.
    """

    fmt: str = "e4m3"
    scale_rule: str = "rceil"

    block: ClassVar[tuple[int, int]] = (1, MX_BLOCK)
    scale_blocks: ClassVar[Blocks] = (block, block)
    pure: ClassVar[bool] = True
    token_block: ClassVar[int] = MX_BLOCK  # (quantize_groups: column-wise blocks along R)

    def over_shards(self, reduce: Any, dim: int) -> MXFP8Quantizer:
        return self  # every scale is a block's: local where shards hold whole blocks

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_fp8_format(name, self.fmt)
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"{name}: scale_rule must be rceil or ocp, got {self.scale_rule!r}")

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> MXFP8Tensor:
        opened = _begin("fastcast.quantize.mxfp8") if _observers else None  # observer point
        try:
            check_input(x)
            if not (rowwise or columnwise):
                raise ValueError(f"{type(self).__name__}: ask for rowwise and/or columnwise data")
            m = as_matrix(x)
            rows, cols = m.shape
            if cols % MX_BLOCK:
                raise ValueError(
                    f"MXFP8 needs the last dimension (K={cols}) to be a multiple of {MX_BLOCK}"
                )
            if columnwise and rows % MX_BLOCK:
                raise ValueError(
                    f"MXFP8 column-wise data needs the row count of the [R, K] view "
                    f"(R={rows}, the product of the leading dimensions) to be a multiple of "
                    f"{MX_BLOCK}"
                )
            data = scale_inv = data_t = scale_inv_t = None
            if rowwise:
                data, scale_inv = quantize_blocks(m, self.fmt, self.scale_rule)
                data = data.reshape(x.shape)
            if columnwise:
                # Blocks run along R: quantize the transposed matrix.
                data_t, scale_inv_t = quantize_blocks(m.t(), self.fmt, self.scale_rule)
            return MXFP8Tensor(
                fmt=self.fmt,
                shape=x.shape,
                dtype=x.dtype,
                data=data,
                scale_inv=scale_inv,
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
    ) -> MXFP8Tensor | None:
        """``m`` ``[R, D]`` per group of rows (``quantizers.groups``): blocks along D are
        each row's own, and along R, from group starts at multiples of 32, each group's;
        None (one ``quantize`` per group) where blocks would span groups."""
        if columnwise and not groups.aligned(MX_BLOCK):
            return None
        return self.quantize(m, rowwise=not columnwise, columnwise=columnwise)
