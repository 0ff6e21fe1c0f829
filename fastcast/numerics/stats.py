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
            ref64.square().sum(),
            (ref64 - deq64).square().sum(),
            finite.sum(),
            nonzero.sum(),
            (nonzero & (deq == 0)).sum(),
            clipped.sum(),
            s_min,
            s_max,
            log_sum,
            torch.tensor(float(usable.numel()), device=ref.device),
            stale,
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
        "sqnr_db": _sqnr(acc["signal"], acc["noise"]),
        "stale": None if math.isnan(acc["stale"]) else acc["stale"],
        "elements": int(elements),
        "calls": acc["calls"],
    }
