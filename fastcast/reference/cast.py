"""The arithmetic every scaling family shares: the scale from an amax, the scaled cast
to FP8 that saturates finite values and keeps non-finite ones, and the amax itself."""

from __future__ import annotations

import math

import torch

from ..formats import ELEMENT_MAX, FP8_DTYPES, FP32_MAX


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` viewed as ``[R, K]`` (copying only if the layout needs it)."""
    shape = x.shape
    # An explicit row count: reshape(-1, 0) is ambiguous when K == 0.
    return x if len(shape) == 2 else x.reshape(math.prod(shape[:-1]), shape[-1])


def scale_and_cast(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """``x * scale`` (an FP32 product; ``scale`` broadcasts to ``x``) as FP8 data, shaped
    like ``x``, which is left untouched.

    Finite values beyond the range saturate to +-max, a finite value whose product
    overflows FP32 included (a large value under a stale delayed scale). Non-finite values
    stay non-finite: +-inf stays +-inf in E5M2; E4M3 (``float8_e4m3fn``) has no infinity,
    so there it becomes NaN. NaN stays NaN. The infinities are taken from ``x``, not from
    the product, which is what tells an input inf from an overflow. ``scale`` is positive
    (every scale fastcast computes is); were it 0 or NaN, an infinite input would still
    dequantize to a non-finite value.
    """
    if fmt == "e4m3":
        # inf -> NaN before scaling (so that an overflow can only come from a finite
        # value), which the clamp then keeps: one in-place pass, no mask.
        if x.dtype == torch.float32:
            y = torch.nan_to_num(x, nan=math.nan, posinf=math.nan, neginf=math.nan)
        else:  # widened first: one FP32 temporary, changed in place from here on
            y = x.float().nan_to_num_(nan=math.nan, posinf=math.nan, neginf=math.nan)
        return _clamp(y.mul_(scale), fmt).to(FP8_DTYPES[fmt])
    y = x * scale if x.dtype == torch.float32 else x.float().mul_(scale)
    data = _clamp(y, fmt).to(FP8_DTYPES[fmt])
    # The clamp turned each input infinity into +-max: add the masks of x's infinities to
    # the codes, one after the other in one buffer. That buffer is the bytes of y, dead
    # after the cast, when y is laid out like x (it saves an allocation).
    if y.shape == x.shape and y.is_contiguous() and x.is_contiguous():
        mask = y.view(-1).view(torch.uint8)[: x.numel()].view(torch.bool).view(x.shape)
        torch.isposinf(x, out=mask)
    else:
        mask = torch.isposinf(x)
    _add_to_codes(data, mask)
    return _add_to_codes(data, torch.isneginf(x, out=mask))


def _clamp(x: torch.Tensor, fmt: str) -> torch.Tensor:
    fmt_max = ELEMENT_MAX[fmt]
    return x.clamp_(-fmt_max, fmt_max)


def _add_to_codes(data: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """E5M2 ``data``: add 1 to the byte where ``mask`` is set (an input infinity that the
    clamp turned into +-max) and return ``data``.

    The max code (0x7B, 0xFB with the sign) plus one is the infinity (0x7C, 0xFC): an
    in-place byte pass instead of a select over FP32 values. (The masks come from
    ``isposinf``/``isneginf``: ``isinf`` would first materialise ``abs(x)``.)
    """
    codes = data.view(torch.uint8)
    codes += mask.view(torch.uint8)  # a bool mask viewed as 0/1 bytes: no conversion copy
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
    FP32 gives the FP32 max. A huge amax gives no less than ``min_scale(fmt_max,
    power_2)``, so that ``fmt_max`` dequantizes to a finite value: finite inputs stay
    finite (saturating) however close to the FP32 max they are. Few tensor operations:
    this runs for every quantization.
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
    if power_2 or margin:  # else fmt_max / amax is at least fmt_max / FP32_MAX already
        scale = scale.clamp_min(min_scale(fmt_max, power_2))
    return torch.where(usable > 0, scale, fallback)


def min_scale(fmt_max: float, power_2: bool) -> float:
    """The smallest scale whose format max dequantizes to a finite FP32 value.

    A scale below it makes the largest codes ``fmt_max * (1 / scale)`` overflow to inf
    (a finite input near the FP32 max, quantized and dequantized, would come back
    infinite). Without ``power_2`` it is ``fmt_max / FP32_MAX`` rounded to FP32 (for
    every element format fastcast has, ``fmt_max * (1 / that)`` rounds to at most the
    FP32 max). With ``power_2``, with ``fmt_max = m * 2**e`` (``0.5 <= m < 1``), it is
    ``2**(e - 128)``: ``fmt_max * 2**(128 - e) = m * 2**128`` is below the FP32 max,
    twice that is not. (The power-of-two scale from such an amax is ``2**(e - 129)``:
    its largest values round to FP8 codes whose dequantized value is ``2**128``.) An
    amax above ``fmt_max / min_scale`` then saturates to ``fmt_max`` at this scale.
    """
    if power_2:
        return math.ldexp(1.0, math.frexp(fmt_max)[1] - 128)
    return fmt_max / FP32_MAX


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an FP32 scalar tensor (NaN if any element is NaN; 0 when empty)."""
    if x.numel() == 0:  # the inf-norm of nothing is an error in torch
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32)
