"""``fc.inspect``: where precision goes, per layer, per quantized operand, per step.

``fc.profiling`` says where time goes; this says where precision goes. While an
inspection is on, every ``every``-th step records, for every ``fc.Linear`` of the model
(named by its qualified name) and every operand it quantizes (``input``, ``weight``,
``grad_output``; the ``rowwise`` and ``columnwise`` layouts it made):

- ``amax``: max |x| of the values the layout quantized (for NVFP4's Hadamard-transformed
  layouts, of the transformed values, which are what its scales see);
- the quantization scale(s) used (``x * scale`` gives the codes): ``scale`` (the
  geometric mean over blocks; the one scale of per-tensor formats), ``scale_min``,
  ``scale_max``;
- ``underflow``: the fraction of the non-zero elements that quantized to zero;
- ``saturated``: the fraction of the elements clipped at the format's maximum (a code at
  the maximum whose value exceeds what it decodes to, in every format: current scaling's
  amax element lands exactly on the maximum and does not count; an NVFP4 block's amax
  element counts when its E4M3 block scale rounded down);
- ``sqnr_db``: ``10 log10(sum x^2 / sum (x - dequantize(quantize(x)))^2)``, over finite
  elements, accumulated in float64 (``inf``: no error at all);
- ``bulk_sqnr_db``: the same over the elements within ``OUTLIER_RATIO`` times the median
  non-zero magnitude, and ``outliers``, the fraction beyond;
- ``rank_db``: the lower of the two SQNRs, which rows are sorted and flagged by (an
  outlier that flushes the rest of its tensor keeps ``sqnr_db`` high, not ``rank_db``);
- ``stale`` (delayed scaling only): this tensor's amax over the amax behind the scale
  it was quantized with (``fmt_max * scale_inv / 2**margin``): above 1 the scale was too
  large (values saturate), far below 1 too small (values underflow).

A layer called several times in one step (micro-batches in one autocast, a shared layer)
is recorded once per (step, layer, operand, layout): sums add up, amax is the largest.

Steps belong to the model. With ``step="autocast"`` (the default) a step begins when
one of its layers runs under an outermost active ``fc.autocast`` entry it has not run
under before: step ``n`` is the model's ``n``-th autocast forward and the backward that
follows it; other threads, tasks and models begin none. With ``step="manual"`` the
inspection starts at step 0 and ``.step()`` begins the next one.

Cost. Nothing is installed on any module and no function is replaced: the inspection
attaches an observer to the state manager's observer point, which ``plan_for`` calls
per eager quantized call (one test when none is attached). On a sampled step it stands
a recording quantizer (``_Tap``) in for each of a layer's three quantizers, in the
layer's plan; the tap quantizes with the layer's own quantizer and computes the
statistics from the codes and scales it returned (dequantizing them, never quantizing
again). The statistics stay on the device until a report is asked for (or the next step
begins), then come to the host in one transfer per observation.

``torch.compile``: compiled code is not inspected (a graph cannot run the taps' Python);
run the sampled steps eagerly. A step whose layers all ran compiled records nothing.

Here: ``inspector.py`` (the inspection and its taps), ``stats.py`` (the statistics of
one layout, and the row they add up to), ``report.py`` (the report and its outputs).
"""

from __future__ import annotations

from .inspector import Inspector, inspect
from .report import DEFAULT_THRESHOLD_DB, METRICS, Report
from .stats import LAYOUTS, OPERANDS, OUTLIER_RATIO, layout_stats

__all__ = [
    "DEFAULT_THRESHOLD_DB",
    "LAYOUTS",
    "METRICS",
    "OPERANDS",
    "OUTLIER_RATIO",
    "Inspector",
    "Report",
    "inspect",
    "layout_stats",
]
