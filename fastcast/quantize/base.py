"""The quantizer protocol and the arithmetic every scaling family shares."""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from ..recipe import ELEMENT_MAX
from ..tensor import FP8_DTYPES, QuantizedTensor

ROLES = ("input", "weight", "grad_output")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP32_MAX = torch.finfo(torch.float32).max


@runtime_checkable
class Quantizer(Protocol):
    """Turns a high-precision tensor into a QuantizedTensor.

    ``rowwise`` produces the layout scaled along the last dim, ``columnwise`` the
    transposed one scaled along the other dim (what backward GEMMs contract over).
    """

    fmt: str

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> QuantizedTensor: ...


def check_input(x: object, what: str = "input") -> torch.Tensor:
    """Refuse what cannot be quantized, naming the problem."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{what} must be float32, bfloat16 or float16 to be quantized, got {x.dtype}"
        )
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension to be quantized")
    return x


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` viewed as ``[R, K]`` (copying only if the layout needs it)."""
    shape = x.shape
    # An explicit row count: reshape(-1, 0) is ambiguous when K == 0.
    return x if len(shape) == 2 else x.reshape(math.prod(shape[:-1]), shape[-1])


def saturating_cast(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP32 values to an FP8 dtype: finite values beyond the range saturate to +-max,
    non-finite values stay non-finite.

    +-inf stays +-inf in E5M2; E4M3 (``float8_e4m3fn``) has no infinity, so there it
    becomes NaN. NaN stays NaN. ``x`` must be a temporary (it is changed in place) whose
    infinities are the input's own: scaling must not have overflowed FP32 (see
    ``scale_and_cast`` for a scale that may).
    """
    if fmt == "e4m3":
        # inf -> NaN first, which the clamp keeps: one in-place pass, no mask.
        x.nan_to_num_(nan=math.nan, posinf=math.nan, neginf=math.nan)
        return _clamp(x, fmt).to(FP8_DTYPES[fmt])
    pos_inf, neg_inf = torch.eq(x, math.inf), torch.eq(x, -math.inf)
    return _restore_infinities(_clamp(x, fmt).to(FP8_DTYPES[fmt]), pos_inf, neg_inf)


def scale_and_cast(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x * scale`` (an FP32 product) to an FP8 dtype, ``x`` left untouched.

    As ``saturating_cast``, except that the infinities are located in ``x`` before it is
    scaled: a finite value whose product overflows FP32 (a large value under a stale,
    large delayed scale) saturates like any other finite value. ``scale`` is positive
    (every scale fastcast computes is); should it be 0 or NaN, an infinite input still
    dequantizes to a non-finite value.
    """
    if fmt == "e4m3":
        if x.dtype == torch.float32:
            y = torch.nan_to_num(x, nan=math.nan, posinf=math.nan, neginf=math.nan)
        else:  # widened first: one FP32 temporary, changed in place from here on
            y = x.float().nan_to_num_(nan=math.nan, posinf=math.nan, neginf=math.nan)
        return _clamp(y.mul_(scale), fmt).to(FP8_DTYPES[fmt])
    pos_inf, neg_inf = torch.eq(x, math.inf), torch.eq(x, -math.inf)
    y = x * scale if x.dtype == torch.float32 else x.float().mul_(scale)
    return _restore_infinities(_clamp(y, fmt).to(FP8_DTYPES[fmt]), pos_inf, neg_inf)


def _clamp(x: torch.Tensor, fmt: str) -> torch.Tensor:
    fmt_max = ELEMENT_MAX[fmt]
    return x.clamp_(-fmt_max, fmt_max)


def _restore_infinities(
    data: torch.Tensor, pos_inf: torch.Tensor, neg_inf: torch.Tensor
) -> torch.Tensor:
    """E5M2 ``data`` whose input infinities were clamped to +-max: make them +-inf again.

    The clamp left the max code (0x7B, 0xFB with the sign) there, and the next code up is
    the infinity (0x7C, 0xFC), so adding the masks to the bytes restores them: two cheap
    in-place byte passes instead of a select over FP32 values.
    """
    codes = data.view(torch.uint8)
    codes += pos_inf
    codes += neg_inf
    return data


def round_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two not above ``scale`` (so scaled values never grow)."""
    mantissa, exponent = torch.frexp(scale)
    # scale = m * 2**e with m in [0.5, 1): 2**(e-1) <= scale.
    return torch.ldexp(torch.ones_like(mantissa), exponent - 1)


def scale_from_amax(
    amax: torch.Tensor,
    fmt_max: float,
    *,
    margin: int = 0,
    power_2: bool = False,
    epsilon: float = 0.0,
    fallback: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Quantization scale ``fmt_max / amax / 2**margin`` (FP32), elementwise.

    amax 0, NaN or infinite gives ``fallback`` (1.0, or the previous scale for delayed
    scaling); ``epsilon`` floors the amax first; a tiny amax whose scale would overflow
    FP32 gives the FP32 max. Few tensor operations: this runs for every quantization.
    """
    amax = amax.float()
    usable = torch.nan_to_num(amax, nan=0.0, posinf=0.0)
    if epsilon > 0:
        # Floor finite amaxes only: NaN/inf must still give the fallback.
        usable = torch.where(torch.isfinite(amax), usable.clamp_min(epsilon), 0.0)
    target = fmt_max / 2.0**margin
    # One correctly rounded division; flooring at target / FP32_MAX keeps it finite.
    scale = torch.div(target, usable.clamp_min(target / FP32_MAX))
    if power_2:
        scale = round_to_power_of_2(scale)
    return torch.where(usable > 0, scale, fallback)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an FP32 scalar tensor (NaN if any element is NaN; 0 when empty)."""
    if x.numel() == 0:  # the inf-norm of nothing is an error in torch
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32)
