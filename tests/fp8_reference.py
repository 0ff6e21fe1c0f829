"""An FP8 reference independent of fastcast (and of torch's FP8 casts), for the tests.

The grids of finite values are decoded from the E4M3 / E5M2 bit layouts; rounding picks
the nearest grid value with ties to the even code and saturates finite values at the
largest finite value. Non-finite values stay non-finite: +-inf is +-inf in E5M2 and NaN
in E4M3 (which has no infinity). Everything is float64 or pure Python.
"""

from __future__ import annotations

import math
import struct

import torch

FMT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP32_MAX = 3.4028234663852886e38


def fp8_grid(fmt: str) -> list[float]:
    """Finite non-negative FP8 values in code order (index == code), from the bit layout."""
    mbits, bias = (3, 7) if fmt == "e4m3" else (2, 15)
    values = []
    for code in range(0x80):
        exp, mant = code >> mbits, code & ((1 << mbits) - 1)
        if fmt == "e4m3" and code == 0x7F:  # S.1111.111 is NaN; E4M3FN has no inf
            break
        if fmt == "e5m2" and exp == 0x1F:  # inf and NaN
            break
        if exp == 0:
            values.append(mant / 2**mbits * 2.0 ** (1 - bias))
        else:
            values.append((1 + mant / 2**mbits) * 2.0 ** (exp - bias))
    return values


GRIDS = {fmt: torch.tensor(fp8_grid(fmt), dtype=torch.float64) for fmt in FMT_MAX}


def encode_fp8(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 values to FP8 codes (uint8): nearest, ties to the even code, finite values
    saturating; +-inf to the E5M2 infinities (0x7C, 0xFC), to NaN in E4M3.

    NaN maps to 0x7F (compare NaN positions separately: torch may pick another NaN code).
    """
    grid = GRIDS[fmt]
    a = v.abs().contiguous()
    hi = torch.searchsorted(grid, a.nan_to_num(0.0)).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(take_hi, hi, lo)
    code = torch.where(a >= grid[-1], len(grid) - 1, code)  # saturate finite values
    if fmt == "e5m2":  # its infinity is the code after the largest finite value
        code = torch.where(a == torch.inf, len(grid), code)
    code = code | torch.where(torch.signbit(v), 0x80, 0)
    not_a_number = v.isnan() if fmt == "e5m2" else ~v.isfinite()  # E4M3: inf is NaN
    return torch.where(not_a_number, 0x7F, code).to(torch.uint8)


def decode_fp8(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 codes (no NaN among them; E5M2 infinities allowed) to float64."""
    grid = GRIDS[fmt]
    index = (codes & 0x7F).long()
    mag = torch.where(index == len(grid), torch.inf, grid[index.clamp(max=len(grid) - 1)])
    return torch.where((codes & 0x80) != 0, -mag, mag)


def to_f32(v: float) -> float:
    """Round a Python float to the nearest FP32 value."""
    return struct.unpack("f", struct.pack("f", v))[0]


def reference_scale(amax: float, fmt: str, power_2: bool = False, eps: float = 0.0) -> float:
    """A quantization scale by its definition, as an FP32 value: ``fmt_max / max(amax,
    eps)`` rounded once to FP32, the FP32 max where the quotient is beyond it, 1.0 for an
    amax that is 0, NaN or infinite; with ``power_2`` the largest power of two not above,
    but never so small that ``fmt_max / scale`` is beyond the FP32 max
    (``power_2_scale_floor``)."""
    if math.isnan(amax) or math.isinf(amax):
        return 1.0
    amax = max(amax, eps)
    if amax == 0:
        return 1.0
    quotient = FMT_MAX[fmt] / amax
    scale = FP32_MAX if quotient >= FP32_MAX else to_f32(quotient)
    if power_2:
        scale = 2.0 ** (math.frexp(scale)[1] - 1)  # largest power of two <= scale
        scale = max(scale, power_2_scale_floor(fmt))
    return scale


def power_2_scale_floor(fmt: str) -> float:
    """The smallest power of two ``s`` with ``fmt_max / s`` at most the FP32 max: a
    smaller scale would let the largest codes dequantize to infinity (finite inputs near
    the FP32 max must stay finite). Searched, in float64, where the division is exact."""
    scale = 2.0**-149
    while FMT_MAX[fmt] / scale > FP32_MAX:
        scale *= 2.0
    return scale


def assert_codes_equal(data: torch.Tensor, expected: torch.Tensor, fmt: str) -> None:
    """FP8 ``data`` holds exactly the ``expected`` codes (NaN anywhere 0x7F is expected)."""
    assert data.dtype == FP8[fmt]
    got = data.reshape(expected.shape).view(torch.uint8)
    nan = expected == 0x7F
    assert torch.equal(data.reshape(expected.shape).float().isnan(), nan)
    mismatch = (got != expected) & ~nan
    if mismatch.any():
        idx = mismatch.nonzero()[0].tolist()
        raise AssertionError(
            f"{int(mismatch.sum())} codes differ, first at {idx}: "
            f"got {int(got[tuple(idx)]):#04x}, expected {int(expected[tuple(idx)]):#04x}"
        )
