"""``DelayedScaling``: per-tensor FP8 with scales from the amax history of earlier steps.

The one stateful scheme, and everything it means lives here:

- per module (saved in its checkpoints): a ``ScalingMeta`` per direction, forward
  (input, weight) and backward (grad_output), whose tensors are column views into one
  ``Slab`` per (autocast key, direction, device) (``fastcast.delayed``), so an update
  costs a fixed number of tensor operations whatever the number of modules;
- per thread (``DelayedThreadState``): the slabs, which of them recorded amaxes since
  their last update, the step claim and the activation-recomputation replay log;
- per call (``DelayedCall``): the quantizers, and whether this call's backward ends the
  step's backward;
- lifecycle: forward scales update when the outermost active autocast exits after a
  training (grad-enabled) or calibrating forward; backward scales after the backward of
  the step's first module, which runs last. Step k quantizes with the scales from amaxes
  up to step k-1.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from ..delayed import BACKWARD, FORWARD, ScalingMeta, Slab
from ..profiling import annotate
from ..quantize.base import Quantizer
from ..quantize.tensorwise import DelayedScalingQuantizer, FixedScaleQuantizer, record_amax
from ..recipe import DelayedScaling
from ..state import AutocastFrame, ThreadState
from ..tensor import TENSORWISE
from .base import Plan, Scheme, register_scheme


class ReplayLog:
    """Scales (and weights) the original forward of a checkpointed region used, replayed
    in the same order by its recomputation."""

    __slots__ = ("recording", "entries", "frame")

    def __init__(self) -> None:
        self.recording = True
        self.entries: collections.deque = collections.deque()
        self.frame: AutocastFrame | None = None

    def push(self, entry: Any) -> None:
        self.entries.append(entry)

    def pop(self) -> Any:
        if not self.entries:
            raise RuntimeError(
                "activation recomputation ran more fastcast modules than the original forward"
            )
        return self.entries.popleft()


class DelayedThreadState:
    """Per-thread delayed-scaling state: slabs by (autocast key, direction, device)."""

    __slots__ = ("slabs", "pending", "step_claimed", "replay")

    def __init__(self) -> None:
        self.slabs: dict[tuple, Slab] = {}
        # Slabs with amaxes recorded since their last update, per direction.
        self.pending: tuple[set[Slab], set[Slab]] = (set(), set())
        # The first module of a step claims it (its backward, the last to run, ends the
        # step's backward); the outermost active autocast's exit clears the claim.
        self.step_claimed = False
        # Set inside an activation-checkpointed region (see fastcast.recompute).
        self.replay: ReplayLog | None = None

    @staticmethod
    def of(ts: ThreadState) -> DelayedThreadState:
        """``ts``'s delayed-scaling state, created on first use."""
        state = ts.schemes.get(DelayedScalingScheme)
        if state is None:
            state = ts.schemes[DelayedScalingScheme] = DelayedThreadState()
        return state

    def claim_step(self) -> bool:
        """True for exactly one caller per outermost autocast: the step's first module."""
        if self.step_claimed:
            return False
        self.step_claimed = True
        return True

    def slab(self, key: tuple, group: Any, direction: int, fmt: str, device: torch.device) -> Slab:
        slab_key = (key, direction, device)
        slab = self.slabs.get(slab_key)
        if slab is None:
            slab = self.slabs[slab_key] = Slab(key[0], group, fmt, device)
        return slab

    def mark(self, slab: Slab, direction: int) -> None:
        self.pending[direction].add(slab)

    @annotate("fastcast.amax_update")
    def end(self, direction: int, group: Any = None) -> None:
        """Update the slabs of one direction that recorded amaxes since their last update.

        Slabs reduced over ``group`` (the step's group) update whether they recorded or
        not: a rank that skipped every module of a slab this step must still join the
        all_reduce (its columns contribute amax 0), or the other ranks would wait
        forever. Slabs of other groups are left alone, so a step under another group (or
        none) issues no collective of theirs. Slabs are visited in creation order, the
        same on every rank.
        """
        pending = self.pending[direction]
        for (_, slab_direction, _), slab in self.slabs.items():
            if slab_direction != direction:
                continue
            if slab in pending or (group is not None and slab.group is group):
                slab.update()
        pending.clear()

    def frame_exited(self, frame: AutocastFrame, ok: bool) -> None:
        """An autocast level exited: the outermost active one ends the forward step.

        Scales move only after training (grad-enabled) or calibrating forwards that
        finished (``ok``); amaxes seen otherwise stay recorded and join the next update.
        """
        if frame.opens_step():
            if ok and (torch.is_grad_enabled() or frame.calibrating):
                self.end(FORWARD, frame.group)
            self.step_claimed = False


class DelayedPlan(Plan):
    """A module's delayed-scaling plan: its metas attached to this thread's slabs."""

    __slots__ = ("state", "fwd_slab", "bwd_slab", "fwd_meta", "bwd_meta")

    def __init__(
        self,
        recipe: DelayedScaling,
        group: Any,
        state: DelayedThreadState,
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

    def matches(self, frame: AutocastFrame, ts: ThreadState) -> bool:
        return (
            frame.recipe is self.recipe
            and frame.group is self.group
            and ts.schemes.get(DelayedScalingScheme) is self.state
        )

    def call(self, ts: ThreadState, autograd: bool) -> DelayedCall:
        return DelayedCall(self, autograd)

    def calibrate(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        record_amax(self.fwd_meta.amax_slots[0], x.detach())
        record_amax(self.fwd_meta.amax_slots[1], weight.detach())
        self.state.mark(self.fwd_slab, FORWARD)


class DelayedCall:
    """What one forward call decided, for its backward (which may run on another thread,
    after the autocast has exited and the scales have moved on)."""

    __slots__ = (
        "plan",
        "input_q",
        "weight_q",
        "grad_q",
        "records",
        "ends_step",
        "replay_entry",
        "replayed_weight",
    )

    def __init__(self, plan: DelayedPlan, autograd: bool) -> None:
        self.plan = plan
        self.input_q: Quantizer = plan.input_q
        self.weight_q, self.grad_q = plan.weight_q, plan.grad_q
        self.records = True
        self.ends_step = False
        self.replay_entry = self.replayed_weight = None
        replay = plan.state.replay
        if replay is not None and not replay.recording:
            self._replay(replay.pop())
            return
        if replay is not None:  # a checkpointed forward: keep what the replay will need
            self.replay_entry = [plan.fwd_meta.scale.clone(), None]
            replay.push(self.replay_entry)
        # Only a module whose backward will run can end the step's backward.
        self.ends_step = autograd and plan.state.claim_step()

    def _replay(self, entry: list) -> None:
        """Under activation recomputation: the original forward's input scale and the very
        weight it used (possibly cached from an earlier micro-batch); record nothing."""
        scale, self.replayed_weight = entry
        self.input_q = FixedScaleQuantizer(scale[0:1], self.plan.recipe.fp8_format.fwd)
        self.records = False

    def remember_weight(self, w_q: Any) -> Any:
        if self.replay_entry is not None:
            self.replay_entry[1] = w_q
        return w_q

    def forward_done(self) -> None:
        if self.records:
            self.plan.state.mark(self.plan.fwd_slab, FORWARD)

    def backward_done(self) -> None:
        plan = self.plan
        plan.state.mark(plan.bwd_slab, BACKWARD)
        if self.ends_step:
            plan.state.end(BACKWARD, plan.group)


@register_scheme(DelayedScaling)
class DelayedScalingScheme(Scheme):
    """Stateful per-tensor FP8; see the module docstring."""

    family = TENSORWISE

    def quantizer(self, recipe: DelayedScaling, role: str, group: Any = None) -> Quantizer:
        raise ValueError(
            "DelayedScaling is stateful (its scales come from an amax history): quantize "
            "through fc.Linear under fc.autocast, or use Float8CurrentScaling"
        )

    def plan(
        self,
        frame: AutocastFrame,
        ts: ThreadState,
        module_state: dict[Any, Any],
        device: torch.device,
    ) -> DelayedPlan:
        """Attach the module's metas (``module_state``: direction -> ScalingMeta, made
        here on first use) to this thread's slabs for the frame's key."""
        recipe = frame.recipe
        state = DelayedThreadState.of(ts)
        key = frame.key()
        fmt = recipe.fp8_format
        slabs, metas = [], []
        for direction, n, elem in ((FORWARD, 2, fmt.fwd), (BACKWARD, 1, fmt.bwd)):
            meta = module_state.get(direction)
            if meta is None:
                meta = module_state[direction] = ScalingMeta(n, recipe.amax_history_len, device)
            elif meta.history.device != device:
                meta.move_to(device)
            slab = state.slab(key, frame.group, direction, elem, device)
            if meta.slab is not slab:
                slab.add(meta)
            slabs.append(slab)
            metas.append(meta)
        return DelayedPlan(recipe, frame.group, state, tuple(slabs), tuple(metas))
