"""MXFP8 (OCP Microscaling v1.0): 32 consecutive elements share one E8M0 scale."""

from __future__ import annotations

import math

import torch

from ..formats import ELEMENT_MAX
from .cast import scale_and_cast

MX_BLOCK = 32
E8M0_BIAS = 127
X_MIN, X_MAX = -127, 127  # shared-exponent range with a finite E8M0 encoding (255 is NaN)
EMAX_ELEM = {"e4m3": 8, "e5m2": 15}  # exponent of the largest normal element value


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
