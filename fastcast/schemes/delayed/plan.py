"""A module's delayed-scaling plan, and what one call of it used.

``DelayedPlan`` holds the module's metas attached to one owner's slabs and the
quantizers reading them; a plain call runs the plan itself (its hooks mark the slabs
that recorded amaxes). Under activation checkpointing a call is a ``DelayedCall``,
which keeps the input scale and quantized weight the original call used, so that its
recomputation replays them.
"""

from __future__ import annotations

from asyncio import current_task
from asyncio.events import _get_running_loop
from typing import Any, ClassVar

import torch

from ...quantizers.base import Quantizer
from ...quantizers.tensorwise import DelayedScalingQuantizer, FixedScaleQuantizer, record_amax
from ...recipe import DelayedScaling
from ...runtime.state import AutocastFrame, thread_state
from ..base import Plan
from .owners import DelayedState
from .state import BACKWARD, FORWARD, ScalingMeta, Slab


class DelayedPlan(Plan):
    """A module's delayed-scaling plan: its metas attached to one owner's slabs."""

    __slots__ = ("state", "fwd_slab", "bwd_slab", "fwd_meta", "bwd_meta")

    def __init__(
        self,
        recipe: DelayedScaling,
        group: Any,
        state: DelayedState,
        slabs: tuple[Slab, Slab],
        metas: tuple[ScalingMeta, ScalingMeta],
    ) -> None:
        fmt = recipe.fp8_format
        fwd_meta, bwd_meta = metas
        quantizers = (
            DelayedScalingQuantizer(fwd_meta, 0, fmt.fwd),
            DelayedScalingQuantizer(fwd_meta, 1, fmt.fwd),
            DelayedScalingQuantizer(bwd_meta, 0, fmt.bwd),
        )
        super().__init__(recipe, group, quantizers)
        self.state = state
        self.fwd_slab, self.bwd_slab = slabs
        self.fwd_meta, self.bwd_meta = metas

    def matches(self, frame: AutocastFrame) -> bool:
        # What DelayedState.of(thread_state()) is self.state says, without its calls.
        if frame.recipe is not self.recipe or frame.group is not self.group:
            return False
        state = self.state
        if state.owner_ts is not thread_state():
            return False
        loop = _get_running_loop()
        task = None if loop is None else current_task(loop)
        if task is None:
            return state.task is None
        return state.task is not None and state.task() is task

    def call(
        self, autograd: bool, replay: Any = None, record: Any = None
    ) -> DelayedPlan | DelayedCall:
        """The plan itself for a plain call (its hooks are the ones a call needs, and its
        quantizers read the scales when they run); a ``DelayedCall`` under activation
        checkpointing, which must carry what the original call used."""
        if replay is None and record is None:
            return self
        return DelayedCall(self, replay, record)

    # -- the per-call hooks of a plain call (``DelayedCall`` has the general ones) ---------
    def forward_done(self) -> None:
        self.state.mark(self.fwd_slab, FORWARD)

    def backward_done(self) -> None:
        state = self.state
        state.mark(self.bwd_slab, BACKWARD)
        state.backward_ran(self.group)

    def calibrate(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        record_amax(self.fwd_meta.amax_slots[0], x.detach())
        record_amax(self.fwd_meta.amax_slots[1], weight.detach())
        self.state.mark(self.fwd_slab, FORWARD)


class DelayedCall:
    """What one forward call used, for its backward (which may run on another thread,
    after the autocast has exited and the scales have moved on)."""

    __slots__ = ("plan", "input_q", "weight_q", "grad_q", "records", "record", "replayed_weight")

    wgrad_high_precision: ClassVar[bool] = False  # every GEMM takes FP8 operands

    def __init__(self, plan: DelayedPlan, replay: Any = None, record: Any = None) -> None:
        self.plan = plan
        self.input_q: Quantizer = plan.input_q
        self.weight_q, self.grad_q = plan.weight_q, plan.grad_q
        self.records = True
        self.record = record
        self.replayed_weight = None
        if replay is not None:
            # A recomputation: the original call's input scale and the very weight it
            # used (possibly cached from an earlier micro-batch); record no forward amax.
            scale, self.replayed_weight = replay[1]
            fmt = plan.recipe.fp8_format.fwd
            self.input_q = FixedScaleQuantizer(scale[0:1], fmt)
            self.weight_q = FixedScaleQuantizer(scale[1:2], fmt)
            self.records = False
            if torch._C._current_graph_task_id() != -1:
                # Recomputed inside the outer backward (reentrant checkpoint): its own
                # backward is a nested pass; the outer pass must end the step.
                plan.state.backward_ran(plan.group)
        elif record is not None:  # a checkpointed call: keep what its replay will need
            record[1] = [plan.fwd_meta.scale.clone(), None]

    def remember_weight(self, w_q: Any) -> Any:
        if self.record is not None:
            self.record[1][1] = w_q
        return w_q

    def forward_done(self) -> None:
        if self.records:
            self.plan.state.mark(self.plan.fwd_slab, FORWARD)

    def backward_done(self) -> None:
        plan = self.plan
        plan.state.mark(plan.bwd_slab, BACKWARD)
        plan.state.backward_ran(plan.group)
