"""``DelayedScaling``: per-tensor FP8 with scales from the amax history of earlier steps.

The one stateful scheme, and everything it means lives here:

- per module (saved in its checkpoints): a ``ScalingMeta`` per direction, forward
  (input, weight) and backward (grad_output), whose tensors are column views into one
  ``Slab`` per (autocast key, direction, device) (``state.py``), so an update
  costs a fixed number of tensor operations whatever the number of modules;
- per owner (``DelayedState``): the slabs, and which of them recorded amaxes since
  their last update. The owner is the asyncio task running the module, or the thread
  when no task runs (``DelayedThreadState`` holds a thread's owners). A module's metas
  join one owner's slabs; using the module from another owner while the first is alive
  (a live thread, a task not done) is refused, so steps of concurrent tasks never see
  each other's updates; the claim is atomic (``_claims``). The thread's own owner
  lends its modules to the tasks of its thread (it cannot run while they do);
- per call (``DelayedCall``): the quantizers; under activation checkpointing the input
  scale and quantized weight the original call used, which its recomputation replays;
- lifecycle: forward scales update when the outermost active autocast exits after a
  training (grad-enabled) or calibrating forward; backward scales when the backward pass
  (the autograd graph task) that ran any delayed-scaling module's backward finishes,
  whichever modules it reached. Step k quantizes with the scales from amaxes up to step
  k-1. Compiled code cannot run these hooks: ``join_compiled`` sets up the same updates
  from eager (``fastcast.compile`` tells how).
"""

from __future__ import annotations

import threading
import weakref
from asyncio import current_task
from asyncio.events import _get_running_loop
from typing import Any, ClassVar

import torch
from torch.autograd import Variable

from ...profiling import annotate
from ...quantizers.base import Quantizer
from ...quantizers.tensorwise import (
    DelayedScalingQuantizer,
    FixedScaleQuantizer,
    record_amax,
)
from ...recipe import DelayedScaling
from ...runtime.state import (
    AutocastFrame,
    Stack,
    ThreadState,
    note_stateful_thread,
    thread_state,
)
from ...tensor import TENSORWISE
from ..base import Plan, Scheme, register_scheme
from .state import BACKWARD, FORWARD, ScalingMeta, ScalingOrigin, Slab


class DelayedState:
    """One owner's delayed-scaling state (an asyncio task's, or a thread's when no task
    runs): slabs by (autocast key, direction, device), and what its step has pending."""

    __slots__ = (
        "slabs",
        "pending",
        "compiled",
        "watched",
        "thread",
        "owner_ts",
        "task",
        "backward_task",
        "backward_groups",
    )

    def __init__(self, thread: threading.Thread, task: Any = None, ts: Any = None) -> None:
        self.slabs: dict[tuple, Slab] = {}
        # Slabs with amaxes recorded since their last update, per direction.
        self.pending: tuple[set[Slab], set[Slab]] = (set(), set())
        # Slabs that compiled code records into: a graph cannot mark them pending, so
        # every update of their direction includes them (see ``join_compiled``).
        self.compiled: set[Slab] = set()
        # id -> the tensor, see watch_backward; an entry goes when its tensor dies.
        self.watched: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.thread = thread  # the thread it runs on
        self.owner_ts = ts  # that thread's ThreadState (plans compare it per call)
        # The asyncio task, weakly (modules keep their owner, not a finished task's
        # result); None for the thread's own state.
        self.task: weakref.ref | None = None if task is None else weakref.ref(task)
        # The backward pass whose end is already queued, and the groups it ran under.
        self.backward_task: int | None = None
        self.backward_groups: list[Any] = []

    @staticmethod
    def of(ts: ThreadState) -> DelayedState:
        """The current owner's state in thread state ``ts``, created on first use."""
        return DelayedThreadState.of(ts).current()

    def alive(self) -> bool:
        """Whether this owner may still run: its thread is alive, its task not done."""
        if self.task is None:
            return self.thread.is_alive()
        task = self.task()
        return task is not None and not task.done() and self.thread.is_alive()

    def describe(self) -> str:
        task = None if self.task is None else self.task()
        if task is None:
            return f"thread {self.thread.name!r}"
        return f"asyncio task {task.get_name()!r} (thread {self.thread.name!r})"

    def slab(self, key: tuple, group: Any, direction: int, fmt: str, device: torch.device) -> Slab:
        slab_key = (key, direction, device)
        slab = self.slabs.get(slab_key)
        if slab is None:
            slab = self.slabs[slab_key] = Slab(key[0], group, fmt, device)
            slab.owner = self
        return slab

    def mark(self, slab: Slab, direction: int) -> None:
        self.pending[direction].add(slab)

    @annotate("fastcast.amax_update")
    def end(self, direction: int, groups: tuple[Any, ...] = ()) -> None:
        """Update the slabs of one direction that recorded amaxes since their last update.

        Slabs reduced over one of ``groups`` (the step's) update whether they recorded or
        not: a rank that skipped every module of a slab this step must still join the
        all_reduce (its columns contribute amax 0), or the other ranks would wait
        forever. Slabs of other groups are left alone, so a step under another group (or
        none) issues no collective of theirs. Slabs are visited in creation order, the
        same on every rank.
        """
        # Taken first: an update that raises must not leave these to raise again forever.
        pending = set(self.pending[direction])
        self.pending[direction].clear()
        for (_, slab_direction, _), slab in self.slabs.items():
            if slab_direction != direction:
                continue
            if (
                slab in pending
                or slab in self.compiled
                or (slab.group is not None and any(slab.group is g for g in groups))
            ):
                slab.update()

    def step_exited(self, frame: AutocastFrame, ok: bool) -> None:
        """The forward step this owner ran in ended (its outermost active autocast exited).

        Scales move only after training (grad-enabled) or calibrating forwards that
        finished (``ok``); amaxes seen otherwise stay recorded and join the next update.
        """
        # A pass whose end is still pending when the next forward step ends failed before
        # its callbacks ran: forget it, so that the next pass queues its own end.
        self.backward_task = None
        if ok and (torch.is_grad_enabled() or frame.calibrating):
            self.end(FORWARD, (frame.group,))

    def backward_ran(self, group: Any) -> None:
        """A module's backward is running (or, under a reentrant checkpoint, about to run
        in a nested pass): have the backward pass end the step when it is over, once per
        pass, whichever modules it reaches.

        The end is queued on the first pass that asks while none is pending; a nested pass
        (a reentrant checkpoint's recomputation backward) finds the outer one's end pending
        and adds to it, so scales move once, after the outermost pass.
        """
        if self.backward_task is None:
            self.backward_task = torch._C._current_graph_task_id()
            self.backward_groups = []
            Variable._execution_engine.queue_callback(self._backward_finished)
        if not any(group is g for g in self.backward_groups):
            self.backward_groups.append(group)

    def watch_backward(self, tensor: torch.Tensor) -> None:
        """Have every backward pass that computes ``tensor``'s gradient end the step.

        Compiled code runs no Python in its backward, so it cannot call ``backward_ran``
        as the eager Function does: a hook on a leaf the module's backward reaches (its
        weight) calls it instead, from the engine, in the same pass. Registered once per
        tensor and state; a pass that did not run delayed scaling then updates nothing
        (columns without a recorded amax keep their history and scale).
        """
        # By identity (tensors compare element-wise, so no set of them).
        if self.watched.get(id(tensor)) is not tensor:
            tensor.register_hook(self._gradient_seen)
            self.watched[id(tensor)] = tensor

    def _gradient_seen(self, grad: torch.Tensor) -> None:
        self.backward_ran(None)

    def _backward_finished(self) -> None:
        groups = tuple(self.backward_groups)
        self.backward_task = None
        self.backward_groups = []
        self.end(BACKWARD, groups)


class DelayedThreadState:
    """A thread's delayed-scaling owners: its own state, and one per asyncio task that ran
    delayed-scaling modules on it. An autocast exit that ends a step ends it for the
    owner running it, and for the finished tasks whose steps it enclosed (tasks a step
    gathered ran their modules under its autocast; their amaxes join its update)."""

    __slots__ = ("thread", "ts", "own", "tasks")

    def __init__(self, thread: threading.Thread, ts: Any = None) -> None:
        self.thread = thread
        self.ts = ts
        self.own = DelayedState(thread, None, ts)
        # Task -> its state, held until a step exit after the task is done has ended its
        # step: a finished task's pending amaxes must reach an update.
        self.tasks: dict[Any, DelayedState] = {}

    @staticmethod
    def of(ts: ThreadState) -> DelayedThreadState:
        """``ts``'s delayed-scaling owners, created on first use."""
        state = ts.schemes.get(DelayedScalingScheme)
        if state is None:
            state = ts.schemes[DelayedScalingScheme] = DelayedThreadState(ts.thread, ts)
            note_stateful_thread(ts)
        return state  # type: ignore[return-value]

    def current(self) -> DelayedState:
        """The state of what runs now: the current asyncio task's, else the thread's."""
        loop = _get_running_loop()
        if loop is None:
            return self.own
        task = current_task(loop)
        if task is None:
            return self.own
        state = self.tasks.get(task)
        if state is None:
            state = self.tasks[task] = DelayedState(self.thread, task, self.ts)
        return state

    def frame_exited(self, frame: AutocastFrame, below: Stack, ok: bool) -> None:
        """An autocast level exited: the outermost active one ends the forward step."""
        if not frame.opens_step(below):
            return
        current = self.current()
        current.step_exited(frame, ok)
        if self.tasks:
            for task, state in list(self.tasks.items()):
                if task.done():
                    if state is not current:
                        state.step_exited(frame, ok)
                    del self.tasks[task]


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


@register_scheme(DelayedScaling)
class DelayedScalingScheme(Scheme):
    """Stateful per-tensor FP8; see the module docstring."""

    family = TENSORWISE

    def quantizer(self, recipe: DelayedScaling, role: str, group: Any = None) -> Quantizer:
        raise ValueError(
            "DelayedScaling is stateful (its scales come from an amax history): quantize "
            "through fc.Linear under fc.autocast, or use Float8CurrentScaling"
        )

    def prepare(
        self, recipe: DelayedScaling, module_state: dict[Any, Any], device: torch.device
    ) -> None:
        """Give the module fresh metas (amaxes 0, scales 1) for the directions it has none
        of; the ones it has are fitted to the recipe when they join a slab."""
        for direction, n, elem in _directions(recipe):
            if direction not in module_state:
                origin = ScalingOrigin.of(recipe, elem)
                module_state[direction] = ScalingMeta(n, recipe.amax_history_len, device, origin)

    def plan(
        self, frame: AutocastFrame, module_state: dict[Any, Any], device: torch.device
    ) -> DelayedPlan:
        """Attach the module's metas (``module_state``: direction -> ScalingMeta, made
        here on first use) to the current owner's slabs for the frame's key."""
        recipe = frame.recipe
        state = DelayedState.of(thread_state())
        key = frame.key()
        # Checked and claimed under one lock: two owners that find the module free at
        # the same moment cannot both take it.
        with _claims:
            for meta in module_state.values():
                _refuse_concurrent_use(meta, state)
            self.prepare(recipe, module_state, device)
            slabs, metas = [], []
            for direction, _, elem in _directions(recipe):
                meta = module_state[direction]
                if meta.history.device != device:
                    meta.move_to(device)
                slab = state.slab(key, frame.group, direction, elem, device)
                if meta.slab is not slab:
                    slab.add(meta)
                slabs.append(slab)
                metas.append(meta)
        return DelayedPlan(recipe, frame.group, state, tuple(slabs), tuple(metas))

    def join_compiled(
        self, frame: AutocastFrame, module_state: dict[Any, Any], params: list[torch.Tensor]
    ) -> None:
        """Eager set-up for compiled code that records into a module's metas (see
        ``fastcast.compile``): attach them to this thread's slabs as ``plan`` does, have
        every update include those slabs, and have the backward pass end the step through
        a hook on the first of ``params`` (the module's) that requires grad.

        A module with none (frozen) has no leaf to hook: refused when grad is enabled,
        since its backward (a gradient for its input) would record amaxes that no hook
        reliably turns into an update.
        """
        watched = next((p for p in params if p.requires_grad), None)
        if watched is None and torch.is_grad_enabled():  # refused before anything changes
            raise RuntimeError(
                "fastcast: DelayedScaling under torch.compile needs each fc.Linear to have "
                "a weight or bias that requires grad (their gradient starts its backward "
                "scale update); run frozen layers under torch.no_grad, or use "
                "Float8CurrentScaling"
            )
        plan = self.plan(frame, module_state, params[0].device)
        plan.state.compiled.update((plan.fwd_slab, plan.bwd_slab))
        if watched is not None:
            plan.state.watch_backward(watched)


def _directions(recipe: DelayedScaling) -> tuple[tuple[int, int, str], ...]:
    """``(direction, columns, element format)``: forward scales the input and weight,
    backward the output gradient."""
    fmt = recipe.fp8_format
    return ((FORWARD, 2, fmt.fwd), (BACKWARD, 1, fmt.bwd))


# Makes a module's check-and-claim atomic across threads (plan builds only, not per call).
_claims = threading.Lock()


def _refuse_concurrent_use(meta: ScalingMeta, state: DelayedState) -> None:
    """A module's metas belong to one owner's slabs at a time; taking them while that
    owner (another thread, or another asyncio task) may still run would race with its
    updates, or move scales in the middle of its step. A thread's own state lends to the
    tasks of the same thread (it cannot run while they do); a finished owner gives up."""
    owner = getattr(meta.slab, "owner", None)
    if owner is None or owner is state or not owner.alive():
        return
    if owner.task is None and owner.thread is state.thread:
        return
    raise RuntimeError(
        f"fastcast: a DelayedScaling module is in use by {owner.describe()}; its amax "
        "history and scales belong to one thread or asyncio task at a time. Give each "
        "thread or task its own copy (copy.deepcopy), or use Float8CurrentScaling, which "
        "keeps no state"
    )
