"""The inspection: which steps are sampled, and the taps that record them.

``Inspector`` is an observer of the state manager's observer points
(``fastcast.runtime.observers``): ``plan_for`` hands it each eager quantized call's
plan. Steps belong to the model: a call of one of its layers under an outermost active
autocast entry it has not seen begins the next step, so other models, threads and tasks
count none. On a sampled step the observer stands a recording quantizer (``_Tap``) in for each of a
layer's quantizers. Observations stay on the device until ``_flush`` brings them to the
host and adds them up per (step, layer, operand, layout).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..nn.linear import Linear
from ..runtime import observers
from ..runtime.state import get_stack, outermost_active
from .report import Report, check_threshold
from .stats import _FIELDS, LAYOUTS, OPERANDS, _derive, _nanmax, layout_stats


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


class Inspector(observers.Observer):
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
        self.threshold_db = check_threshold(threshold_db)
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
        # step="autocast": the autocast stack of the model's last quantized call, and its
        # outermost active node (that of the step's entry); held, so never another's id.
        self._last_stack: Any = None
        self._entry: Any = None
        self._plans: list[Any] = []  # plans whose quantizers are taps now
        self._recipes: dict[str, Any] = {}  # layer -> the recipe it ran
        self._pending: list[tuple[tuple, str, torch.Tensor]] = []
        self._acc: dict[tuple, dict[str, Any]] = {}

    # -- on and off ----------------------------------------------------------------------
    def start(self) -> Inspector:
        """Start recording (with ``step="manual"``, step 0 begins now)."""
        if self._active:
            raise RuntimeError("fc.inspect: this inspection is already on")
        if any(isinstance(o, Inspector) for o in observers.attached):
            raise RuntimeError("fc.inspect: another inspection is on; stop it first")
        observers.attach(self)
        self._active = True
        if self.step_mode == "manual":
            self._begin(self._step + 1)
        return self

    def stop(self) -> None:
        """Stop recording and detach (every layer's own quantizers are back)."""
        if not self._active:
            return
        self._active = False
        observers.detach(self)
        self._set_sampling(False)
        self._last_stack = self._entry = None
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
                "fc.inspect: steps begin at each outermost fc.autocast entry the model runs "
                "in here; pass step='manual' to fc.inspect to step by hand"
            )
        if not self._active:
            raise RuntimeError("fc.inspect: the inspection is not on (start it first)")
        self._begin(self._step + 1)

    def report(self, threshold_db: float | dict[str, float] | None = None) -> Report:
        """What has been recorded so far (``threshold_db``: instead of the inspection's)."""
        threshold = self.threshold_db if threshold_db is None else check_threshold(threshold_db)
        self._flush()
        return Report(
            [_derive(key, acc) for key, acc in self._acc.items()], threshold, self._recipes
        )

    # -- steps ---------------------------------------------------------------------------
    def plan(self, module: Any, frame: Any, plan: Any) -> Any:
        """The observer point: ``plan`` as the call runs it (tapped on sampled steps)."""
        name = self._names.get(module)
        if name is None or not frame.enabled or torch.compiler.is_compiling():
            return plan  # another model's layer, a calibrating call, a trace
        if self.step_mode == "autocast":
            stack = get_stack()
            # A new innermost level: maybe a new entry. (A recomputation under activation
            # checkpointing runs under its original call's frame, not this stack's: it
            # belongs to the step that is on.)
            if stack is not self._last_stack and stack[0] is frame:
                self._last_stack = stack
                entry = outermost_active(stack)
                if entry is not self._entry:
                    self._entry = entry
                    self._begin(self._step + 1)
        if self._sampling and type(plan.grad_q) is not _Tap:
            self._tap(plan, name)
        return plan

    def _begin(self, index: int) -> None:
        self._step = index
        self._flush()
        self._set_sampling(index % self.every == 0)

    def _set_sampling(self, on: bool) -> None:
        if on == self._sampling:
            return
        self._sampling = on
        if on:
            return  # the observer taps each layer's plan at its first call in the step
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
        # Headroom against the margin where the scale is a history's, not the tensor's.
        margin = tap.margin if getattr(tap.inner, "from_history", False) else None
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
            for name in (
                "signal",
                "noise",
                "bulk_signal",
                "bulk_noise",
                "elements",
                "nonzero",
                "underflow",
                "saturated",
                "outliers",
            ):
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
    ``step``: ``"autocast"`` (a step begins at each outermost ``fc.autocast`` entry in
    which the model's layers run, whatever other threads, tasks and models do) or
    ``"manual"`` (``insp.step()``). ``threshold_db``: the level (dB) below which an operand
    is flagged, one number or one per element format (``{"e4m3": 25.0}``; the others
    keep ``DEFAULT_THRESHOLD_DB``); checked here.
    """
    return Inspector(model, every, step=step, threshold_db=threshold_db)
