"""The state manager: fastcast's only process-wide and per-context state.

Invariant: autocast frames live in a context variable (per thread and asyncio task, never
leaking back from ``to_thread`` or ``copy_context().run``); stateful schemes' state lives
per thread, and backward reads only what the module captured at forward time.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import weakref
from typing import Any, Protocol

from torch.utils.weak import WeakIdKeyDictionary

from ..recipe import Recipe


class AutocastFrame:
    """One level of autocast: what modules read on the hot path.

    ``autocast`` subclasses this; ``OUTSIDE`` is the frame below every autocast.
    """

    # ``ran``: set by the fastcast layers that run quantized under this frame (one store
    # per forward), read when an enabled autocast exits (fc.autocast warns if none did).
    __slots__ = ("enabled", "recipe", "calibrating", "group", "ran", "_key")

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
        self.ran = False

    @property
    def active(self) -> bool:
        """Whether modules in this frame quantize or record amaxes."""
        return self.enabled or self.calibrating

    def opens_step(self, below: Stack | None = None) -> bool:
        """Whether this frame is the outermost active (enabled or calibrating) level.

        ``below``: the stack under it (found in the current context when not given). In
        enabled -> disabled -> enabled only the first level opens the step.
        """
        if not self.active:
            return False
        if below is None:
            node = get_stack()
            while node is not None and node[0] is not self:
                node = node[1]
            below = node[1] if node is not None else None
        while below is not None:  # (a loop, not any(): this runs on every exit)
            if below[0].active:
                return False
            below = below[1]
        return True

    def key(self) -> tuple:
        """This frame's autocast key: ``(recipe, group id)``; computed once per frame."""
        try:
            return self._key
        except AttributeError:  # first call: the slot is left unset to keep __init__ short
            key = self._key = autocast_key(self.recipe, self.group)
            return key


OUTSIDE = AutocastFrame(enabled=False, recipe=None)

# A stack: ``[innermost frame, the stack below (None at the bottom), the token of the set
# that pushed it]``, never changed once entered. Exiting resets the token (the previous
# stack comes back; a token from another context is refused).
Stack = list  # [AutocastFrame, "Stack | None", contextvars.Token | None]
BOTTOM: Stack = [OUTSIDE, None, None]

_stack: contextvars.ContextVar[Stack] = contextvars.ContextVar("fastcast_autocast", default=BOTTOM)
get_stack = _stack.get
set_stack = _stack.set
reset_stack = _stack.reset


def current_frame() -> AutocastFrame:
    """The innermost autocast frame of this context (``OUTSIDE`` when none)."""
    return get_stack()[0]


def is_autocast_enabled() -> bool:
    """Whether FP8 autocast is enabled in the current context (thread, asyncio task)."""
    return get_stack()[0].enabled


def get_autocast_recipe() -> Recipe | None:
    """The recipe of the innermost autocast; None outside any autocast."""
    return get_stack()[0].recipe


def mark_ran(frame: AutocastFrame) -> None:
    """Called by a fastcast layer that runs quantized under ``frame`` (see ``ran``)."""
    frame.ran = True


def outermost_active(stack: Stack) -> Stack | None:
    """The node of ``stack`` whose frame is its outermost active level (None: none is):
    one per entry of that level, so the identity of one step of the code that entered it."""
    outer = None
    while stack is not None:
        if stack[0].active:
            outer = stack
        stack = stack[1]
    return outer


class AutocastState:
    """What ``fc.autocast`` keeps process-wide and reads on every call, in Python and in C
    (one struct: the C side reads these slots at the offsets ``autocast.native_contract()``
    hands it, and holds the two sets, which are never rebound).

    - ``warning_due``: an enabled autocast that saw no fastcast layer run still has to be
      warned about (once per process).
    - ``stateful_threads``: how many live thread states hold a stateful scheme's state;
      while none does (stateless recipes only), the exit skips the per-thread look-up.
      Counted up when a thread state first holds one, down when it is freed, under a lock.
    - ``runnable``: recipe types that passed the support check on this machine (a memo of
      a fixed fact, emptied when the hardware answers are refreshed).
    - ``recipe_types``: recipe types constructors have seen (the argument check's fast path).
    """

    __slots__ = ("warning_due", "stateful_threads", "runnable", "recipe_types")

    def __init__(self) -> None:
        self.warning_due = True
        self.stateful_threads = 0
        self.runnable: set[type] = set()
        self.recipe_types: set[type] = set()


autocast_state = AutocastState()


class _CompiledView:
    """The autocast stack as ``torch.compile``'d code reads it (``fastcast.compile``
    substitutes ``traced_*`` for the accessors above while tracing).

    ``context`` is a property whose getter is the context variable's own C ``get``:
    Dynamo reads it for real while tracing and guards on its value, so compiled code sees
    the stack of the context that calls it, as eager code does. A context that never set
    the variable gives the view itself (the getter's default), standing for ``BOTTOM``.
    ``traced``: the stack an autocast entered in traced code pushed (None: none); Dynamo
    replays the last write after the graph, None again once traced autocasts exited.
    """

    context = property(_stack.get)

    def __init__(self) -> None:
        self.traced: Stack | None = None


compiled_view = _CompiledView()


def traced_get_stack() -> Stack:
    """``get_stack`` in traced code: the stack pushed in the trace, else the context's."""
    stack = compiled_view.traced
    if stack is None:
        stack = compiled_view.context
        if stack is compiled_view:
            return BOTTOM
    return stack


def traced_set_stack(stack: Stack) -> Stack | None:
    """``set_stack`` in traced code; the "token" is what ``traced_reset_stack`` restores."""
    token = compiled_view.traced
    compiled_view.traced = stack
    return token


def traced_reset_stack(token: Any) -> None:
    """``reset_stack`` in traced code: back to the stack before the matching set."""
    if token is not None and not isinstance(token, list):
        raise RuntimeError(
            "fastcast: an fc.autocast entered outside the compiled function cannot be "
            "exited inside it; enter and exit it on the same side"
        )
    compiled_view.traced = token


class UnsafeExtraState:
    """``fc.allow_unsafe_extra_state``'s mechanism: a permission per entry, per context.

    Each entry opens a permission (a one-element list, ``[open]``) and pushes it on this
    context's chain ``(permission, below)``; readers walk the chain for an open one. The
    exit closes *its* permission, wherever it runs: a generator that holds the block
    across a ``yield`` and is closed from another context (or thread) still takes the
    permission back from the context that entered it, whose chain keeps only a closed
    entry. The instance keeps its open permissions (it may be entered again while active,
    or in several contexts): an exit closes the innermost one this context sees, else
    the instance's most recent.
    """

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: list[tuple[list[bool], contextvars.Token]] = []

    def __enter__(self) -> Any:
        permission = [True]
        token = _unsafe.set((permission, _unsafe.get()))
        self._open.append((permission, token))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        opened = self._open
        mine = {id(permission): i for i, (permission, _) in enumerate(opened)}
        node = _unsafe.get()
        while node is not None and id(node[0]) not in mine:
            node = node[1]
        permission, token = opened.pop(len(opened) - 1 if node is None else mine[id(node[0])])
        permission[0] = False
        if node is not None and node is _unsafe.get():  # the innermost here: pop it too
            try:
                _unsafe.reset(token)
            except ValueError:  # entered in the context this one was copied from
                _unsafe.set(node[1])


# The chain of ``fc.allow_unsafe_extra_state`` permissions of this context.
_unsafe: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "fastcast_unsafe_extra_state", default=None
)


def unsafe_extra_state_allowed() -> bool:
    """Whether a foreign pickled extra state may be unpickled here (checkpoint.py)."""
    node = _unsafe.get()
    while node is not None:
        if node[0][0]:
            return True
        node = node[1]
    return False


def frames(stack: Stack | None) -> Any:
    """The frames of ``stack``, innermost first (``OUTSIDE`` last)."""
    while stack is not None:
        yield stack[0]
        stack = stack[1]


class SchemeThreadState(Protocol):
    """What a stateful scheme keeps per thread: told when an autocast level exits."""

    def frame_exited(self, frame: AutocastFrame, below: Stack, ok: bool) -> None: ...


class ThreadState:
    """What stateful schemes keep for one thread (delayed scaling: its slabs)."""

    __slots__ = ("schemes", "thread", "__weakref__")

    def __init__(self) -> None:
        # One entry per stateful scheme that ran in this thread; autocast's exit notifies
        # each. Empty for stateless recipes, so their exit pays one truth test.
        self.schemes: dict[type, SchemeThreadState] = {}
        self.thread = threading.current_thread()


_threads = threading.local()
_stateful_lock = threading.Lock()  # ``+=`` on an attribute is not atomic across threads


def note_stateful_thread(ts: ThreadState) -> None:
    """Called once per thread state when a stateful scheme first keeps state in it."""
    with _stateful_lock:
        autocast_state.stateful_threads += 1
    weakref.finalize(ts, _forget_stateful_thread)


def _forget_stateful_thread() -> None:
    with _stateful_lock:
        autocast_state.stateful_threads -= 1


def thread_state() -> ThreadState:
    """This thread's state object, created on first use."""
    try:
        return _threads.state
    except AttributeError:
        ts = _threads.state = ThreadState()
        return ts


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
            if entry is not None and entry[0]() is group:
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


# The recipes each process group's ranks were found to agree on
# (``fastcast.distributed.agreement``): group -> set of recipes. Kept here, with the rest of
# fastcast's process-wide state, because a ``ProcessGroup`` (a pybind11 object without a
# ``__dict__``) cannot carry the set itself. Weak keys: a group's entry goes with the group,
# so a later group that reuses its address starts unchecked. (ProcessGroup compares and
# hashes by identity.)
agreed_recipes: weakref.WeakKeyDictionary[Any, set[Recipe]] = weakref.WeakKeyDictionary()

# Sequence parallelism's quantized gathers by the input DTensor they were made from (the
# layers given one input share its gather; nn.sequence_parallel): an entry goes with its input.
gathered_inputs: WeakIdKeyDictionary = WeakIdKeyDictionary()
