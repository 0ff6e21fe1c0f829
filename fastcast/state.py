"""The state manager: per-thread autocast frames, autocast keys, stateful schemes' slots.

Each thread has its own stack of autocast frames (a linked list through ``_prev``), so
two threads entering different recipes never see each other's state. Whatever backward
needs is captured by the module at forward time, because autograd may run backward on
another thread.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import weakref
from typing import Any, Protocol

from .hardware import on_refresh
from .recipe import Recipe


class AutocastFrame:
    """One level of autocast: what modules read on the hot path.

    ``autocast`` subclasses this; ``OUTSIDE`` is the frame below every autocast.
    """

    __slots__ = ("enabled", "recipe", "calibrating", "group", "_prev", "_ts", "_key")

    def __init__(
        self,
        enabled: bool,
        recipe: Recipe | None,
        calibrating: bool = False,
        group: Any = None,
    ) -> None:
        self.enabled = enabled
        self.recipe = recipe
        self.calibrating = calibrating
        self.group = group
        self._prev: AutocastFrame | None = None

    @property
    def active(self) -> bool:
        """Whether modules in this frame quantize or record amaxes."""
        return self.enabled or self.calibrating

    def opens_step(self) -> bool:
        """Whether this frame is the outermost active (enabled or calibrating) one.

        Looks down the whole chain: in enabled -> disabled -> enabled, only the first
        level opens the step. Called on exit only, by threads with delayed scaling.
        """
        if not self.active:
            return False
        frame = self._prev
        while frame is not None:
            if frame.active:
                return False
            frame = frame._prev
        return True

    def key(self) -> tuple:
        """This frame's autocast key: ``(recipe, group id)``; computed once per frame."""
        try:
            return self._key
        except AttributeError:  # first call: the slot is left unset to keep __init__ short
            key = self._key = autocast_key(self.recipe, self.group)
            return key


OUTSIDE = AutocastFrame(enabled=False, recipe=None)


class ThreadState:
    """The state of one thread: its innermost frame, and what stateful schemes keep."""

    __slots__ = (
        "frame",
        "last_good_recipe",
        "other_good_recipe",
        "schemes",
        "unsafe_extra_state",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.frame: AutocastFrame = OUTSIDE
        # The two recipes that last passed autocast's support check in this thread.
        self.last_good_recipe: Recipe | None = None
        self.other_good_recipe: Recipe | None = None
        # One entry per stateful scheme that ran in this thread (delayed scaling: its
        # slabs and step bookkeeping); autocast's exit notifies each. Empty for stateless
        # recipes, so their exit pays one truth test.
        self.schemes: dict[type, SchemeThreadState] = {}
        # Depth of ``fc.allow_unsafe_extra_state`` blocks: above 0, a foreign pickled
        # extra state may be unpickled in this thread (see checkpoint.py).
        self.unsafe_extra_state = 0


class SchemeThreadState(Protocol):
    """What a stateful scheme keeps per thread: told when an autocast level exits."""

    def frame_exited(self, frame: AutocastFrame, ok: bool) -> None: ...


# One ThreadState per thread, held in a context variable: every thread starts with an
# empty context, so it gets its own object on first use, and reading a context variable
# costs a third of a threading.local attribute. (asyncio tasks share their thread's.)
_thread_state: contextvars.ContextVar[ThreadState] = contextvars.ContextVar("fastcast_state")
get_thread_state = _thread_state.get  # raises LookupError before the thread's first use


# Every live thread's state, so that a capability refresh can reach all threads.
_all_thread_states: weakref.WeakSet[ThreadState] = weakref.WeakSet()


def thread_state() -> ThreadState:
    """This thread's state object, created on first use."""
    try:
        return get_thread_state()
    except LookupError:
        ts = ThreadState()
        _thread_state.set(ts)
        _all_thread_states.add(ts)
        return ts


@on_refresh
def forget_checked_recipes() -> None:
    """Make every thread check its next recipe again (after a capability refresh)."""
    for ts in list(_all_thread_states):
        ts.last_good_recipe = ts.other_good_recipe = None


def current_frame() -> AutocastFrame:
    """The innermost autocast frame of this thread (``OUTSIDE`` when none)."""
    return thread_state().frame


def is_autocast_enabled() -> bool:
    """Whether FP8 autocast is enabled in the current thread."""
    return thread_state().frame.enabled


def get_autocast_recipe() -> Recipe | None:
    """The recipe of the innermost autocast of this thread; None outside any autocast."""
    return thread_state().frame.recipe


class _GroupIds:
    """Process-wide serial numbers for process groups, never reused.

    ``id()`` of a freed group can be handed to a new one; a serial cannot. Groups are held
    weakly where they allow it, strongly otherwise (then they are never freed, so the
    serial still cannot be reused).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(group) -> (weak or strong reference, serial). Keyed by identity: two groups
        # that happen to compare equal are still two groups.
        self._by_id: dict[int, tuple[Any, int]] = {}
        self._counter = itertools.count(1)

    def serial(self, group: Any) -> int:
        with self._lock:
            entry = self._by_id.get(id(group))
            if entry is not None and _deref(entry[0]) is group:
                return entry[1]
            serial = next(self._counter)
            try:
                ref: Any = weakref.ref(group, self._forget)
            except TypeError:  # not weak-referenceable: keep it alive instead
                ref = _Strong(group)
            self._by_id[id(group)] = (ref, serial)
            return serial

    def _forget(self, ref: weakref.ref) -> None:
        with self._lock:
            for key, (held, _) in list(self._by_id.items()):
                if held is ref:
                    del self._by_id[key]


class _Strong:
    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


def _deref(ref: Any) -> Any:
    return ref()


_group_ids = _GroupIds()


def autocast_key(recipe: Recipe | None, group: Any = None) -> tuple:
    """An unambiguous key for a (recipe, amax reduction group) pair.

    Recipes compare by value, so equal recipes share a key whatever object they are;
    the group enters by a serial number that is never reused. No repr is involved.
    """
    return (recipe, 0 if group is None else _group_ids.serial(group))


class _OptimizerSteps:
    """Process-wide count of optimizer steps, for weight caches to key on.

    A fused optimizer updates weights without moving their version counters; a cache
    keyed on this count as well dies with any step. The global step hook is installed
    the first time a cache asks for it, not at import.
    """

    __slots__ = ("count", "_handle")

    def __init__(self) -> None:
        self.count = 0
        self._handle: Any = None

    def __call__(self, install: bool = False) -> int:
        if install and self._handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: PLC0415

            self._handle = register_optimizer_step_post_hook(self._bump)
        return self.count

    def _bump(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.count += 1


optimizer_steps = _OptimizerSteps()
