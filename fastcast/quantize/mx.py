"""MXFP8 (OCP Microscaling v1.0): 32 consecutive elements share one E8M0 scale.

Non-finite values stay non-finite (``MXFP8Quantizer`` has the details): NaN is NaN, +-inf
is +-inf in E5M2 and NaN in E4M3; they are left out of their block's amax, so the rest of
the block keeps its precision. Only finite values beyond the element max saturate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ..kernels import fused_op
from ..profiling import annotate
from ..recipe import ELEMENT_MAX
from ..tensor import FP8_DTYPES, MXFP8Tensor
from .base import as_matrix, check_fp8_format, check_input, scale_and_cast

MX_BLOCK = 32
E8M0_BIAS = 127
X_MIN, X_MAX = -127, 127  # shared-exponent range with a finite E8M0 encoding (255 is NaN)
EMAX_ELEM = {"e4m3": 8, "e5m2": 15}  # exponent of the largest normal element value
SCALE_RULES = ("rceil", "ocp")


def shared_exponent(amax: torch.Tensor, fmt: str, rule: str) -> torch.Tensor:
    """The unbiased shared exponent X (int32) of blocks whose max magnitude is ``amax``.

    Computed exactly from ``frexp`` (``amax = m * 2**e``, ``0.5 <= m < 1``), never from a
    rounded ``log2``:

    - ``ocp``: ``floor(log2(amax)) - emax_elem`` = ``e - 1 - emax_elem``;
    - ``rceil``: ``ceil(log2(amax / fmt_max))``. With ``fmt_max = mf * 2**ef`` the ratio
      is ``(m / mf) * 2**(e - ef)`` and ``m / mf`` lies in ``(0.5, 2)``, so X is
      ``e - ef`` plus one exactly when ``m > mf``.

    amax 0 gives -127. The result is clamped to ``[-127, x_max(fmt)]`` (an infinite amax
    gives ``x_max``; ``quantize_blocks`` passes finite amaxes only): above ``x_max`` the
    element max times ``2**X`` would overflow FP32. Only ``rceil`` reaches past it, by
    one, for an amax above ``fmt_max * 2**x_max`` (``ocp``'s X is at most ``x_max``):
    there the two rules agree, and the block's largest elements saturate.
    """
    mantissa, exponent = torch.frexp(amax)
    if rule == "ocp":
        x = exponent - (1 + EMAX_ELEM[fmt])
    else:
        fmt_mantissa, fmt_exponent = math.frexp(ELEMENT_MAX[fmt])
        x = exponent - fmt_exponent + (mantissa > fmt_mantissa).to(torch.int32)
    x = torch.where(amax == 0, X_MIN, x)
    x = torch.where(amax == math.inf, x_max(fmt), x)
    return x.clamp_(X_MIN, x_max(fmt))


def x_max(fmt: str) -> int:
    """The largest shared exponent whose blocks dequantize to finite values:
    ``fmt_max * 2**X`` (``fmt_max < 2**(emax_elem + 1)``) stays below ``2**128`` for
    ``X <= 127 - emax_elem`` (119 for E4M3, 112 for E5M2). With ``rceil``, an amax above
    ``fmt_max * 2**x_max`` would get ``x_max + 1``, and its largest values would round to
    FP8 codes that dequantize to ``2**128``: infinite from a finite input."""
    return X_MAX - EMAX_ELEM[fmt]


def power_of_2(n: torch.Tensor) -> torch.Tensor:
    """``2.0**n`` as FP32 for integer ``n`` in ``[-127, 127]``, built from its bits (exact)."""
    normal = (n + 127) << 23  # biased exponent field, zero mantissa
    bits = torch.where(n >= -126, normal, 1 << 22)  # 2**-127 is the subnormal 0x00400000
    return bits.to(torch.int32).view(torch.float32)


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


def quantize_blocks_reference(
    m: torch.Tensor, fmt: str, rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_blocks`` in PyTorch operations (the definition the fused operators match)."""
    m = m.contiguous()
    rows, cols = m.shape
    blocks = m.reshape(rows, cols // MX_BLOCK, MX_BLOCK).float()
    # Non-finite elements do not take part in the amax (an all-NaN block has amax 0), so
    # an inf does not flush the rest of its block to zero; it stays non-finite in the data.
    amax = blocks.abs().nan_to_num_(nan=0.0, posinf=0.0).amax(dim=-1)
    x = shared_exponent(amax, fmt, rule)
    # Multiplying by a power of two is exact until the result leaves the FP32 normal
    # range, far below the smallest FP8 subnormal, so only the FP8 cast rounds.
    data = scale_and_cast(blocks, power_of_2(-x).unsqueeze(-1), fmt)
    data = data.reshape(rows, cols).contiguous()
    return data, (x + E8M0_BIAS).to(torch.uint8)


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

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_fp8_format(name, self.fmt)
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"{name}: scale_rule must be rceil or ocp, got {self.scale_rule!r}")

    @annotate("fastcast.quantize.mxfp8")
    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> MXFP8Tensor:
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
