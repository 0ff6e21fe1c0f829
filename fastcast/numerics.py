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
  the maximum whose value exceeds what it decodes to: the amax element that current
  scaling maps exactly onto the maximum does not count);
- ``sqnr_db``: ``10 log10(sum x^2 / sum (x - dequantize(quantize(x)))^2)``, over finite
  elements, accumulated in float64 (``inf``: no error at all);
- ``stale`` (delayed scaling only): this tensor's amax over the amax behind the scale
  it was quantized with (``fmt_max * scale_inv / 2**margin``): above 1 the scale was too
  large (values saturate), far below 1 too small (values underflow).

A layer called several times in one step (micro-batches in one autocast, a shared layer)
is recorded once per (step, layer, operand, layout): sums add up, amax is the largest.

Steps. With ``step="autocast"`` (the default) a step begins at each entry of an
outermost enabled ``fc.autocast``: step ``n`` is the ``n``-th forward and the backward
that follows it (backward normally runs after the autocast has exited). With
``step="manual"`` the inspection starts at step 0 and ``.step()`` begins the next one.

Cost. Nothing is installed on any module: no hook, and the hot path has no check. On a
sampled step the inspection stands a recording quantizer (``_Tap``) in for each of a
layer's three quantizers, in the layer's plan, through a wrapper of ``plan_for`` that is
in place only during sampled steps; the tap quantizes with the layer's own quantizer and
computes the statistics from the codes and scales it returned (dequantizing them, never
quantizing again). Between sampled steps everything is put back; with ``step="autocast"``
the only thing left in place is a wrapper of ``fc.autocast.__enter__`` (one call per
step, not per layer). The statistics stay on the device until a report is asked for (or
the next step begins), then come to the host in one transfer per observation.

``torch.compile``: compiled code is not inspected (a graph cannot run the taps' Python);
run the sampled steps eagerly. A step whose layers all ran compiled records nothing.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .autocast import autocast as _autocast
from .formats import ELEMENT_MAX
from .nn import linear as _linear
from .nn.linear import Linear
from .quantizers.tensorwise import DelayedScalingQuantizer
from .recipe import Format
from .reference.cast import as_matrix
from .reference.hadamard import transform_rows
from .runtime.state import frames, get_stack

OPERANDS = ("input", "weight", "grad_output")
LAYOUTS = ("rowwise", "columnwise")
METRICS = ("sqnr_db", "underflow", "saturated")

# Default SQNR thresholds (dB) per element format, below which a layer is flagged. The
# training-step benchmark's operands quantize at about 31 dB in E4M3, 25.5 dB in E5M2 and
# 17 dB in NVFP4's E2M1 blocks (docs/numerics.md); the thresholds sit 6 dB (4x the noise
# power) below those.
DEFAULT_THRESHOLD_DB: dict[str, float] = {"e4m3": 25.0, "e5m2": 19.0, "e2m1": 11.0}

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


# --------------------------------------------------------------------------- the tap


class _Tap:
    """A layer's quantizer during a sampled step: quantizes with it, then records.

    Every attribute other than ``quantize`` is the wrapped quantizer's (``fmt``, a
    delayed quantizer's ``meta``), so code reading them sees the layer's own.
    """

    __slots__ = ("inner", "layer", "operand", "inspector", "margin")

    def __init__(
        self, inner: Any, layer: str, operand: str, inspector: Inspector, margin: int
    ) -> None:
        self.inner = inner
        self.layer = layer
        self.operand = operand
        self.inspector = inspector
        self.margin = margin

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def quantize(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False) -> Any:
        q = self.inner.quantize(x, rowwise=rowwise, columnwise=columnwise)
        if not torch.compiler.is_compiling():
            self.inspector._observe(self, x, q)
        return q


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


# --------------------------------------------------------------------------- the inspection


class Inspector:
    """An inspection of ``model``'s ``fc.Linear`` layers (see the module docstring).

    A context manager (``with fc.inspect(model, every=10) as insp: ...``) or a
    ``start()``/``stop()`` pair; ``report()`` at any time gives what has been recorded.
    One inspection at a time per process.
    """

    def __init__(
        self,
        model: nn.Module,
        every: int = 1,
        *,
        step: str = "autocast",
        threshold_db: float | dict[str, float] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"fc.inspect: model must be an nn.Module, got {type(model).__name__}")
        if type(every) is not int or every < 1:
            raise ValueError(f"fc.inspect: every must be an int >= 1, got {every!r}")
        if step not in ("autocast", "manual"):
            raise ValueError(f"fc.inspect: step must be 'autocast' or 'manual', got {step!r}")
        self.every = every
        self.step_mode = step
        self.threshold_db = threshold_db
        # Layer -> qualified name, weakly: the inspection keeps no module alive.
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                self._names[module] = name or module._fc_name or "(model)"
        if not len(self._names):
            raise ValueError(
                "fc.inspect: the model has no fc.Linear layer to inspect (fc.convert it first)"
            )
        self._step = -1
        self._active = False
        self._sampling = False
        self._plans: list[Any] = []  # plans whose quantizers are taps now
        self._recipes: dict[str, Any] = {}  # layer -> the recipe it ran
        self._pending: list[tuple[tuple, str, torch.Tensor]] = []
        self._acc: dict[tuple, dict[str, Any]] = {}
        self._saved_enter: Any = None
        self._saved_plan_for: Any = None

    # -- on and off ----------------------------------------------------------------------
    def start(self) -> Inspector:
        """Start recording (with ``step="manual"``, step 0 begins now)."""
        if self._active:
            raise RuntimeError("fc.inspect: this inspection is already on")
        if getattr(_autocast.__dict__["__enter__"], "_fc_inspector", None) is not None or (
            getattr(_linear.plan_for, "_fc_inspector", None) is not None
        ):
            raise RuntimeError("fc.inspect: another inspection is on; stop it first")
        self._active = True
        if self.step_mode == "autocast":
            self._install_enter()
        else:
            self._begin(self._step + 1)
        return self

    def stop(self) -> None:
        """Stop recording and put back everything the inspection replaced."""
        if not self._active:
            return
        self._active = False
        self._set_sampling(False)
        if self._saved_enter is not None:
            if _autocast.__dict__["__enter__"] is getattr(self, "_enter_wrapper", None):
                _autocast.__enter__ = self._saved_enter
            self._saved_enter = None
            self._enter_wrapper = None
        self._flush()

    def __enter__(self) -> Inspector:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def current_step(self) -> int:
        """The step being recorded or skipped (-1 before the first)."""
        return self._step

    def step(self) -> None:
        """Begin the next step (``step="manual"`` only)."""
        if self.step_mode != "manual":
            raise RuntimeError(
                "fc.inspect: steps begin at each outermost fc.autocast entry here; pass "
                "step='manual' to fc.inspect to step by hand"
            )
        if not self._active:
            raise RuntimeError("fc.inspect: the inspection is not on (start it first)")
        self._begin(self._step + 1)

    def report(self, threshold_db: float | dict[str, float] | None = None) -> Report:
        """What has been recorded so far."""
        self._flush()
        threshold = self.threshold_db if threshold_db is None else threshold_db
        return Report(
            [_derive(key, acc) for key, acc in self._acc.items()], threshold, self._recipes
        )

    # -- steps ---------------------------------------------------------------------------
    def _install_enter(self) -> None:
        original = _autocast.__dict__["__enter__"]
        begin_next = self._begin_next

        def enter(frame: Any) -> Any:
            # An outermost enabled level begins a step (before it is entered).
            if frame.enabled and not torch.compiler.is_compiling():
                if not any(f.active for f in frames(get_stack())):
                    begin_next()
            return original(frame)

        enter._fc_inspector = True  # type: ignore[attr-defined]
        self._saved_enter, self._enter_wrapper = original, enter
        _autocast.__enter__ = enter

    def _begin_next(self) -> None:
        self._begin(self._step + 1)

    def _begin(self, index: int) -> None:
        self._step = index
        self._flush()
        self._set_sampling(index % self.every == 0)

    def _set_sampling(self, on: bool) -> None:
        if on == self._sampling:
            return
        self._sampling = on
        if on:
            original = _linear.plan_for
            names, tap = self._names, self._tap

            def plan_for(module: Any, frame: Any, weight: torch.Tensor) -> Any:
                plan = original(module, frame, weight)
                if type(plan.grad_q) is not _Tap and not torch.compiler.is_compiling():
                    name = names.get(module)
                    if name is not None:
                        tap(plan, name)
                return plan

            plan_for._fc_inspector = True  # type: ignore[attr-defined]
            self._saved_plan_for, self._plan_for_wrapper = original, plan_for
            _linear.plan_for = plan_for
            return
        if _linear.plan_for is getattr(self, "_plan_for_wrapper", None):
            _linear.plan_for = self._saved_plan_for
        self._saved_plan_for = self._plan_for_wrapper = None
        for plan in self._plans:
            for attr in ("input_q", "weight_q", "grad_q"):
                q = getattr(plan, attr)
                if type(q) is _Tap:
                    setattr(plan, attr, q.inner)
        self._plans = []

    def _tap(self, plan: Any, name: str) -> None:
        recipe = plan.recipe
        self._recipes[name] = recipe
        margin = getattr(recipe, "margin", 0)
        for attr, operand in zip(("input_q", "weight_q", "grad_q"), OPERANDS):
            setattr(plan, attr, _Tap(getattr(plan, attr), name, operand, self, margin))
        self._plans.append(plan)

    # -- recording -----------------------------------------------------------------------
    def _observe(self, tap: _Tap, x: torch.Tensor, q: Any) -> None:
        if not self._active:  # a backward that outlived stop() (its call kept the taps)
            return
        margin = tap.margin if isinstance(tap.inner, DelayedScalingQuantizer) else None
        for layout in LAYOUTS:
            present = q.has_rowwise if layout == "rowwise" else q.has_columnwise
            if present:
                key = (self._step, tap.layer, tap.operand, layout)
                self._pending.append((key, q.fmt, layout_stats(x, q, layout, margin)))

    def _flush(self) -> None:
        """Bring pending statistics to the host and add them up."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        host = torch.stack([p[2].cpu() for p in pending]).tolist()
        for (key, fmt, _), values in zip(pending, host):
            stats = dict(zip(_FIELDS, values))
            acc = self._acc.get(key)
            if acc is None:
                self._acc[key] = {**stats, "fmt": fmt, "calls": 1}
                continue
            acc["calls"] += 1
            for name in ("signal", "noise", "elements", "nonzero", "underflow", "saturated"):
                acc[name] += stats[name]
            acc["log_scale_sum"] += stats["log_scale_sum"]
            acc["scales"] += stats["scales"]
            acc["amax"] = _nanmax(acc["amax"], stats["amax"])
            acc["scale_max"] = _nanmax(acc["scale_max"], stats["scale_max"])
            acc["scale_min"] = -_nanmax(-acc["scale_min"], -stats["scale_min"])
            acc["stale"] = _nanmax(acc["stale"], stats["stale"])


def inspect(
    model: nn.Module,
    every: int = 1,
    *,
    step: str = "autocast",
    threshold_db: float | dict[str, float] | None = None,
) -> Inspector:
    """Record FP8/FP4 numerics of ``model``'s ``fc.Linear`` layers every ``every`` steps.

    ``with fc.inspect(model, every=10) as insp: train(...)``, then ``print(insp.report())``.
    ``step``: ``"autocast"`` (a step begins at each outermost ``fc.autocast`` entry) or
    ``"manual"`` (``insp.step()``). ``threshold_db``: SQNR below which a layer is flagged,
    one number or one per element format (``DEFAULT_THRESHOLD_DB`` otherwise).
    """
    return Inspector(model, every, step=step, threshold_db=threshold_db)


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


def _worst_first(row: dict[str, Any]) -> tuple:
    sqnr = row["sqnr_db"]
    return (-math.inf if math.isnan(sqnr) else sqnr, -row["underflow"], -row["saturated"])


# --------------------------------------------------------------------------- the report


class Report:
    """What an inspection recorded: rows, a per-layer table, the layers to act on."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        threshold_db: float | dict[str, float] | None = None,
        recipes: dict[str, Any] | None = None,
    ) -> None:
        self._rows = sorted(rows, key=_worst_first)
        if threshold_db is None:
            threshold_db = DEFAULT_THRESHOLD_DB
        self.threshold_db = threshold_db
        self._recipes = dict(recipes or {})

    def threshold(self, fmt: str) -> float:
        """The SQNR (dB) below which an operand in ``fmt`` is flagged."""
        if isinstance(self.threshold_db, dict):
            return self.threshold_db.get(fmt, DEFAULT_THRESHOLD_DB.get(fmt, 0.0))
        return float(self.threshold_db)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (step, layer, operand, layout), worst SQNR first: ``layer``,
        ``operand``, ``layout``, ``step``, ``fmt``, ``amax``, ``scale`` (geomean over
        blocks), ``scale_min``, ``scale_max``, ``underflow``, ``saturated``, ``sqnr_db``,
        ``stale`` (delayed scaling; else None), ``elements``, ``calls``."""
        return [dict(r) for r in self._rows]

    def steps(self) -> list[int]:
        return sorted({r["step"] for r in self._rows})

    def summary(self) -> list[dict[str, Any]]:
        """Per (layer, operand, layout) over the recorded steps, worst SQNR first: the
        worst and mean SQNR, the largest underflow, saturation, amax and staleness, the
        scale spread (smallest and largest block scale seen)."""
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for row in self._rows:
            groups.setdefault((row["layer"], row["operand"], row["layout"]), []).append(row)
        out = []
        for (layer, operand, layout), rows in groups.items():
            finite = [r["sqnr_db"] for r in rows if math.isfinite(r["sqnr_db"])]
            stales = [r["stale"] for r in rows if r["stale"] is not None]
            out.append(
                {
                    "layer": layer,
                    "operand": operand,
                    "layout": layout,
                    "fmt": rows[0]["fmt"],
                    "steps": len(rows),
                    "sqnr_db": min(r["sqnr_db"] for r in rows),
                    "sqnr_db_mean": sum(finite) / len(finite) if finite else math.inf,
                    "underflow": max(r["underflow"] for r in rows),
                    "saturated": max(r["saturated"] for r in rows),
                    "amax": max(r["amax"] for r in rows),
                    "scale_min": min(r["scale_min"] for r in rows),
                    "scale_max": max(r["scale_max"] for r in rows),
                    "stale": max(stales) if stales else None,
                }
            )
        return sorted(out, key=_worst_first)

    def flagged(self) -> list[str]:
        """Layers with an operand whose SQNR fell below its format's threshold, worst
        first."""
        names: list[str] = []
        for row in self.summary():
            if row["sqnr_db"] < self.threshold(row["fmt"]) and row["layer"] not in names:
                names.append(row["layer"])
        return names

    def _cold_start(self) -> list[str]:
        """Flagged delayed-scaling layers whose low SQNR comes from the first recorded step
        alone (step 0 quantizes with the initial scales, 1: no amax recorded yet)."""
        first = min(self.steps(), default=0)
        cold = []
        for layer in self.flagged():
            below = [
                r
                for r in self._rows
                if r["layer"] == layer and r["sqnr_db"] < self.threshold(r["fmt"])
            ]
            if first == 0 and all(r["step"] == first and r["stale"] is not None for r in below):
                cold.append(layer)
        return cold

    def actions(self) -> list[str]:
        """One-line changes that would act on what the report shows."""
        out: list[str] = []
        cold = self._cold_start()
        flagged = [n for n in self.flagged() if n not in cold]
        if cold:
            out.append(
                f"{len(cold)} delayed-scaling layer(s) fall below the threshold at step 0 only "
                "(initial scales, no amax history yet): calibrate before training, "
                "with fc.autocast(enabled=False, calibrating=True): model(batch)"
            )
        if flagged:
            names = ", ".join(repr(n) for n in flagged)
            comma = "," if len(flagged) == 1 else ""
            out.append(
                f"keep {len(flagged)} layer(s) in high precision (SQNR below threshold): "
                f"fc.convert(model, fc.keep_high_precision(model, names=({names}{comma})), "
                "recipe=recipe)"
            )
        # HYBRID's E5M2 gradients: suggested when they are the weak operand (3 dB or more
        # below the E4M3 operands, or below their threshold), leaving out a delayed-scaling
        # cold start (step 0), which E4M3 would not cure.
        skip_first = bool(cold)
        by_recipe: dict[Any, tuple[list[float], list[float], list[dict[str, Any]]]] = {}
        for row in self._rows:
            recipe = self._recipes.get(row["layer"])
            if getattr(recipe, "fp8_format", None) is not Format.HYBRID:
                continue
            if (skip_first and row["step"] == 0) or not math.isfinite(row["sqnr_db"]):
                continue
            e4, e5, rows = by_recipe.setdefault(recipe, ([], [], []))
            if row["fmt"] == "e5m2":
                e5.append(row["sqnr_db"])
                rows.append(row)
            else:
                e4.append(row["sqnr_db"])
        for recipe, (e4, e5, rows) in by_recipe.items():
            if not e5 or not e4:
                continue
            m4, m5 = sum(e4) / len(e4), sum(e5) / len(e5)
            if m4 - m5 >= 3.0 or min(e5) < self.threshold("e5m2"):
                underflow = max(r["underflow"] for r in rows)
                out.append(
                    f"E5M2 gradients are the weak operand ({m5:.1f} dB mean against "
                    f"{m4:.1f} dB for the E4M3 operands, underflow up to {underflow:.2%}): "
                    f"recipe = fc.{type(recipe).__name__}(fp8_format=fc.Format.E4M3)"
                )
        # Scales too small for the tensor, and values clipped for it (0.1% or more).
        stale = [
            r
            for r in self._rows
            if r["stale"] is not None and r["stale"] > 1.0 and r["saturated"] >= 1e-3
        ]
        if stale:
            worst = max(stale, key=lambda r: r["stale"])
            out.append(
                f"delayed scales too old ({worst['layer']} {worst['operand']} at step "
                f"{worst['step']}: amax "
                f"{worst['stale']:.2f}x the amax behind its scale, saturated "
                f"{worst['saturated']:.2%}): recipe = fc.DelayedScaling(margin=1) (or "
                "amax_history_len=16, or fc.Float8CurrentScaling())"
            )
        return out

    def table(self, limit: int | None = None) -> str:
        """The per-layer table (markdown), worst first; ``limit`` rows at most."""
        header = (
            "| layer | operand | layout | fmt | steps | worst SQNR dB | mean SQNR dB | "
            "underflow | saturated | amax | scale min..max | stale |"
        )
        lines = [header, "|" + "---|" * 12]
        rows = self.summary()
        for row in rows[:limit] if limit else rows:
            mark = " **!**" if row["sqnr_db"] < self.threshold(row["fmt"]) else ""
            stale = "" if row["stale"] is None else f"{row['stale']:.2f}"
            lines.append(
                f"| {row['layer']}{mark} | {row['operand']} | {row['layout']} | {row['fmt']} | "
                f"{row['steps']} | {row['sqnr_db']:.1f} | {row['sqnr_db_mean']:.1f} | "
                f"{row['underflow']:.2%} | {row['saturated']:.3%} | {row['amax']:.3g} | "
                f"{row['scale_min']:.3g}..{row['scale_max']:.3g} | {stale} |"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        if not self._rows:
            return (
                "fc.inspect: nothing recorded (no sampled step ran an fc.Linear eagerly "
                "under fc.autocast)"
            )
        parts = [self.table()]
        actions = self.actions()
        if actions:
            parts.append("\n".join(f"- {a}" for a in actions))
        return "\n\n".join(parts)

    def to_jsonl(self, path: str | os.PathLike[str]) -> None:
        """``rows()`` as JSON lines (standard JSON: an exact, infinite SQNR is null)."""
        with open(path, "w") as f:
            for row in self._rows:
                clean = {
                    k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in row.items()
                }
                f.write(json.dumps(clean) + "\n")

    def heatmap(
        self,
        path: str | os.PathLike[str],
        metric: str = "sqnr_db",
        *,
        operands: Iterable[str] = OPERANDS,
        title: str | None = None,
    ) -> None:
        """A PNG: one row per (layer, operand) (its worst layout), one column per step,
        coloured by ``metric`` (``sqnr_db``, ``underflow`` or ``saturated``). Needs
        matplotlib."""
        if metric not in METRICS:
            raise ValueError(f"fc.inspect heatmap: metric must be one of {METRICS}, got {metric!r}")
        try:
            import matplotlib  # noqa: PLC0415 - optional: the [bench] extra

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: PLC0415
        except ImportError:
            raise ImportError(
                "fastcast.numerics: the heatmap needs matplotlib (pip install matplotlib); "
                "rows(), table() and to_jsonl() do not"
            ) from None
        if not self._rows:
            raise ValueError("fc.inspect heatmap: nothing recorded")
        operands = tuple(operands)
        steps = self.steps()
        labels: list[str] = []
        order = {}
        for row in sorted(self._rows, key=lambda r: (r["layer"], OPERANDS.index(r["operand"]))):
            label = f"{row['layer']} {row['operand']}"
            if row["operand"] in operands and label not in order:
                order[label] = len(labels)
                labels.append(label)
        worse = min if metric == "sqnr_db" else max
        grid = [[math.nan] * len(steps) for _ in labels]
        column = {s: i for i, s in enumerate(steps)}
        for row in self._rows:
            label = f"{row['layer']} {row['operand']}"
            if label not in order:
                continue
            value = row[metric]
            if metric == "sqnr_db" and not math.isfinite(value):
                value = 99.0 if value > 0 else math.nan
            cell = grid[order[label]][column[row["step"]]]
            grid[order[label]][column[row["step"]]] = (
                value if math.isnan(cell) else worse(cell, value)
            )
        fig, ax = plt.subplots(figsize=(max(4.0, 0.3 * len(steps) + 3), 0.28 * len(labels) + 1.5))
        cmap = "viridis" if metric == "sqnr_db" else "magma_r"
        image = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ticks = list(range(0, len(steps), max(1, len(steps) // 12)))
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
        ax.set_xlabel("step")
        names = {
            "sqnr_db": "SQNR (dB)",
            "underflow": "underflow fraction",
            "saturated": "saturated",
        }
        fig.colorbar(image, ax=ax, label=names[metric])
        ax.set_title(title or f"fc.inspect: {names[metric]} per layer and step", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)

    def to_tensorboard(self, writer_or_dir: Any) -> None:
        """Write the rows as TensorBoard scalars (``numerics/<layer>/<operand>/<layout>/
        <metric>`` at each step): a ``SummaryWriter`` or a log directory. Needs
        ``torch.utils.tensorboard`` (the ``tensorboard`` package)."""
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
        except ImportError:
            raise ImportError(
                "fastcast.numerics: TensorBoard output needs the tensorboard package "
                "(pip install tensorboard)"
            ) from None
        own = not hasattr(writer_or_dir, "add_scalar")
        writer = SummaryWriter(writer_or_dir) if own else writer_or_dir
        for row in sorted(self._rows, key=lambda r: r["step"]):
            tag = f"numerics/{row['layer']}/{row['operand']}/{row['layout']}"
            for metric in METRICS:
                value = row[metric]
                if math.isfinite(value):
                    writer.add_scalar(f"{tag}/{metric}", value, row["step"])
        if own:
            writer.close()


# Keep the names a reader of this module looks for together.
__all__ = ["DEFAULT_THRESHOLD_DB", "Inspector", "Report", "inspect", "layout_stats"]
