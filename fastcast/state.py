"""The state manager: per-thread autocast frames, autocast keys, the amax registry.

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
from typing import Any

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
        """Whether this active frame sits directly on an inactive one (a step's outermost)."""
        prev = self._prev  # set while the frame is active
        return (self.enabled or self.calibrating) and not (prev.enabled or prev.calibrating)

    def key(self) -> tuple:
        """This frame's autocast key: ``(recipe, group id)``; computed once per frame."""
        try:
            return self._key
        except AttributeError:  # first call: the slot is left unset to keep __init__ short
            key = self._key = autocast_key(self.recipe, self.group)
            return key


OUTSIDE = AutocastFrame(enabled=False, recipe=None)


class ThreadState:
    """The state of one thread: its innermost frame and its delayed-scaling registry."""

    __slots__ = ("frame", "step_claimed", "registry", "last_good_recipe", "replay")

    def __init__(self) -> None:
        self.frame: AutocastFrame = OUTSIDE
        # The first delayed-scaling module of a step claims it (its backward, the last
        # to run, ends the step); the outermost active autocast's exit clears the claim.
        self.step_claimed = False
        self.registry: Any = None  # the delayed-scaling registry, created on first use
        self.last_good_recipe: Recipe | None = None  # passed the support check here
        # Set inside an activation-checkpointed region (see recompute.py).
        self.replay: Any = None


# One ThreadState per thread, held in a context variable: every thread starts with an
# empty context, so it gets its own object on first use, and reading a context variable
# costs a third of a threading.local attribute. (asyncio tasks share their thread's.)
_thread_state: contextvars.ContextVar[ThreadState] = contextvars.ContextVar("fastcast_state")
get_thread_state = _thread_state.get  # raises LookupError before the thread's first use


def thread_state() -> ThreadState:
    """This thread's state object, created on first use."""
    try:
        return get_thread_state()
    except LookupError:
        ts = ThreadState()
        _thread_state.set(ts)
        return ts


def current_frame() -> AutocastFrame:
    """The innermost autocast frame of this thread (``OUTSIDE`` when none)."""
    return thread_state().frame


def is_autocast_enabled() -> bool:
    """Whether FP8 autocast is enabled in the current thread."""
    return thread_state().frame.enabled


def get_autocast_recipe() -> Recipe | None:
    """The recipe of the innermost autocast of this thread; None outside any autocast."""
    return thread_state().frame.recipe


def claim_step_start(ts: ThreadState) -> bool:
    """True for exactly one caller per outermost autocast: the step's first module."""
    if ts.step_claimed:
        return False
    ts.step_claimed = True
    return True


class _GroupIds:
    """Process-wide serial numbers for process groups, never reused.

    ``id()`` of a freed group can be handed to a new one; a serial cannot. Groups are held
    weakly where they allow it, strongly otherwise (then they are never freed, so the
    serial still cannot be reused).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._weak: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._strong: dict[int, tuple[Any, int]] = {}
        self._counter = itertools.count(1)

    def serial(self, group: Any) -> int:
        with self._lock:
            try:
                serial = self._weak.get(group)
                if serial is None:
                    serial = self._weak[group] = next(self._counter)
                return serial
            except TypeError:  # not weak-referenceable
                entry = self._strong.get(id(group))
                if entry is None or entry[0] is not group:
                    entry = self._strong[id(group)] = (group, next(self._counter))
                return entry[1]


_group_ids = _GroupIds()


def autocast_key(recipe: Recipe | None, group: Any = None) -> tuple:
    """An unambiguous key for a (recipe, amax reduction group) pair.

    Recipes compare by value, so equal recipes share a key whatever object they are;
    the group enters by a serial number that is never reused. No repr is involved.
    """
    return (recipe, 0 if group is None else _group_ids.serial(group))
