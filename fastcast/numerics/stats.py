"""The statistics of one quantized layout, and the row they add up to.

``layout_stats`` reads a layout's codes and scales (dequantizing them, never quantizing
again) against the values it quantized and returns ``_FIELDS`` as one float64 tensor on
the device, so an observation costs no transfer until a report is asked for.
``_derive`` turns the sums of one (step, layer, operand, layout) into a report row.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..formats import ELEMENT_MAX
from ..reference.cast import as_matrix
from ..reference.hadamard import transform_rows

OPERANDS = ("input", "weight", "grad_output")
LAYOUTS = ("rowwise", "columnwise")

# Relative slack when telling a clipped element from one that decodes to exactly the
# maximum (the amax element of current scaling: its product rounds in FP32).
_CLIP_SLACK = 1e-5

# The bulk of a layout: its elements no larger than OUTLIER_RATIO times the median
# magnitude of its non-zero ones; the others are its outliers. 16x the median is beyond
# every element of a Gaussian or Laplace tensor of this size (0 and <0.1% left out), so
# there the bulk is the tensor; an outlier feature is left out and the bulk's SQNR shows
# what its scale did to everything else (flushed to zero: about 0 dB).
OUTLIER_RATIO = 16.0

# Per observation, the order of the statistics in the one tensor that crosses to the host.
_FIELDS = (
    "amax",
    "signal",
    "noise",
    "elements",
    "nonzero",
    "underflow",
    "saturated",
    "scale_min",
    "scale_max",
    "log_scale_sum",
    "scales",
    "stale",
    "bulk_signal",
    "bulk_noise",
    "outliers",
)


def layout_stats(
    x: torch.Tensor, q: Any, layout: str, delayed_margin: int | None = None
) -> torch.Tensor:
    """The statistics (``_FIELDS``, float64, on ``x``'s device) of one layout of ``q``,
    the quantized ``x``: from its codes and scales, dequantized, against ``x``."""
    with torch.no_grad():
        op = q if layout == "rowwise" else q.columnwise_operand()
        deq = op.dequantize_rowwise_2d()  # FP32 [R, K] (or [K, R]); no inverse transform
        ref = as_matrix(x.detach()).float()
        if layout == "columnwise":
            ref = ref.t()
        rht = getattr(op, "rht", None)
        if rht is not None:  # the layout holds the Hadamard transform: compare it so
            ref = transform_rows(ref, rht)
        values = op._decode_data(op.data).reshape(deq.shape)  # codes as element values
        fmt_max = ELEMENT_MAX[q.fmt]
        finite = torch.isfinite(ref)
        ref = torch.where(finite, ref, 0.0)
        deq = torch.where(finite, deq, 0.0)
        ref64, deq64 = ref.double(), deq.double()
        mag = ref.abs()
        nonzero = mag > 0
        signal, noise = ref64.square(), (ref64 - deq64).square()
        median = mag.new_full((), math.nan)  # stays NaN without a non-zero element
        if mag.numel():
            median = torch.nanmedian(torch.where(nonzero, mag, math.nan))
        bulk = mag <= OUTLIER_RATIO * median  # (all False when the median is NaN)
        clipped = (values.abs() == fmt_max) & (mag > deq.abs() * (1 + _CLIP_SLACK))
        amax = mag.max() if mag.numel() else mag.new_zeros(())
        scale_inv = op._decode_scales(op.scale_inv).float().reshape(-1)
        usable = scale_inv[(scale_inv > 0) & torch.isfinite(scale_inv)]
        if usable.numel():
            scales = usable.reciprocal()
            s_min, s_max, log_sum = scales.min(), scales.max(), scales.log().double().sum()
        else:
            s_min = s_max = log_sum = amax.new_full((), math.nan)
        stale = amax.new_full((), math.nan)
        if delayed_margin is not None and usable.numel():
            behind = fmt_max * usable[0] / 2.0**delayed_margin  # per tensor: one scale
            stale = amax / behind
        stats = [
            amax,
            signal.sum(),
            noise.sum(),
            finite.sum(),
            nonzero.sum(),
            (nonzero & (deq == 0)).sum(),
            clipped.sum(),
            s_min,
            s_max,
            log_sum,
            torch.tensor(float(usable.numel()), device=ref.device),
            stale,
            torch.where(bulk, signal, 0.0).sum(),
            torch.where(bulk, noise, 0.0).sum(),
            (nonzero & ~bulk).sum(),
        ]
        return torch.stack([s.to(device=ref.device, dtype=torch.float64) for s in stats])


def _nanmax(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


def _sqnr(signal: float, noise: float) -> float:
    if noise <= 0:
        return math.inf
    if signal <= 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def _derive(key: tuple, acc: dict[str, Any]) -> dict[str, Any]:
    step, layer, operand, layout = key
    scales = acc["scales"]
    nonzero, elements = acc["nonzero"], acc["elements"]
    sqnr = _sqnr(acc["signal"], acc["noise"])
    bulk = _sqnr(acc["bulk_signal"], acc["bulk_noise"]) if acc["bulk_signal"] else sqnr
    return {
        "layer": layer,
        "operand": operand,
        "layout": layout,
        "step": step,
        "fmt": acc["fmt"],
        "amax": acc["amax"],
        "scale": math.exp(acc["log_scale_sum"] / scales) if scales else math.nan,
        "scale_min": acc["scale_min"],
        "scale_max": acc["scale_max"],
        "underflow": acc["underflow"] / nonzero if nonzero else 0.0,
        "saturated": acc["saturated"] / elements if elements else 0.0,
        "rank_db": min(sqnr, bulk),
        "sqnr_db": sqnr,
        "bulk_sqnr_db": bulk,
        "outliers": acc["outliers"] / elements if elements else 0.0,
        "stale": None if math.isnan(acc["stale"]) else acc["stale"],
        "elements": int(elements),
        "calls": acc["calls"],
    }
