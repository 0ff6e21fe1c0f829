"""Who owns delayed-scaling state, and when its updates run.

An owner is the asyncio task running a module, or the thread when no task runs.
``DelayedState`` is one owner's: its slabs by (autocast key, direction, device), which
of them recorded amaxes since their last update, and the step's end (the outermost
active autocast's exit for the forward scales, the end of the backward pass for the
backward ones). ``DelayedThreadState`` holds a thread's owners and is what the thread
state (``runtime.state``) notifies on each autocast exit. A module's metas belong to one
owner at a time (``refuse_concurrent_use``, under the ``claims`` lock).
"""

from __future__ import annotations

import threading
import weakref
from asyncio import current_task
from asyncio.events import _get_running_loop
from typing import Any

import torch
from torch.autograd import Variable

from ...runtime.observers import attached as _observers
from ...runtime.observers import begin as _begin
from ...runtime.observers import end as _end
from ...runtime.state import AutocastFrame, Stack, ThreadState, note_stateful_thread
from .state import BACKWARD, FORWARD, ScalingMeta, Slab


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
        opened = _begin("fastcast.amax_update") if _observers else None  # observer point
        try:
            pending = set(self.pending[direction])
            self.pending[direction].clear()
            if len(pending) < 2 and not self.compiled and _no_group(groups):
                # The usual eager step: at most one slab to update, so no order to keep, and
                # no group of the step's whose slabs must join in without having recorded.
                for slab in pending:
                    slab.update()
                return
            for (_, slab_direction, _), slab in self.slabs.items():
                if slab_direction != direction:
                    continue
                if (
                    slab in pending
                    or slab in self.compiled
                    or (slab.group is not None and any(slab.group is g for g in groups))
                ):
                    slab.update()
        finally:
            if opened is not None:
                _end(opened)

    def step_exited(self, frame: AutocastFrame, ok: bool) -> None:
        """The forward step this owner ran in ended (its outermost active autocast exited).

        Scales move only after training (grad-enabled) or calibrating forwards that
        finished (``ok``); amaxes of finished no-grad forwards stay recorded and join the
        next update. A forward that raised records nothing: the amaxes recorded since the
        last update are dropped, so the next step quantizes with the scales it would have
        had (a failed step's outliers must not set them).
        """
        # A pass whose end is still pending when the next forward step ends failed before
        # its callbacks ran: forget it, so that the next pass queues its own end.
        self.backward_task = None
        if not ok:
            self.discard(FORWARD)
        elif torch.is_grad_enabled() or frame.calibrating:
            self.end(FORWARD, (frame.group,))

    def discard(self, direction: int) -> None:
        """Forget the amaxes recorded in one direction since the last update (history row
        0, the step being recorded); the window and scales stay as they are."""
        pending = self.pending[direction]
        for (_, slab_direction, _), slab in self.slabs.items():
            if slab_direction == direction and (slab in pending or slab in self.compiled):
                slab.history[0].zero_()
        pending.clear()

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
        for known in self.backward_groups:
            if known is group:
                return
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


def _no_group(groups: tuple[Any, ...]) -> bool:
    """Whether ``groups`` holds no process group (a loop, for the per-step hot path)."""
    for group in groups:
        if group is not None:
            return False
    return True


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
        """``ts``'s delayed-scaling owners, created on first use (kept under this class
        in ``ts.schemes``, one entry per stateful scheme)."""
        state = ts.schemes.get(DelayedThreadState)
        if state is None:
            state = ts.schemes[DelayedThreadState] = DelayedThreadState(ts.thread, ts)
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


# Makes a module's check-and-claim atomic across threads (plan builds only, not per call).
claims = threading.Lock()


def refuse_concurrent_use(meta: ScalingMeta, state: DelayedState) -> None:
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
