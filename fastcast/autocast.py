"""``fc.autocast``: the context manager that turns FP8 on for the modules inside it."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from .recipe import Recipe
from .runtime.hardware import default_device_type, on_refresh
from .runtime.observers import attached as _observers
from .runtime.observers import begin as _begin
from .runtime.observers import end as _end
from .runtime.state import (
    AutocastFrame,
    Stack,
    autocast_state,
    frames,
    get_stack,
    reset_stack,
    set_stack,
    thread_state,
)
from .runtime.state import _stack as _state_stack
from .schemes import default_recipe, scheme_for

try:  # built by the install (setup.py) where a C compiler is; optional
    from .runtime import _native
except ImportError:  # the Python methods below run instead: the same semantics
    _native = None

F = TypeVar("F", bound=Callable[..., Any])

# The state manager's sets (see state.AutocastState), bound once: never rebound there.
_runnable = autocast_state.runnable
on_refresh(_runnable.clear)
_recipe_types = autocast_state.recipe_types

_NOT_HERE = (
    "fc.autocast: exiting an autocast that is not active here (it already exited, or it "
    "was entered in another thread, task or context)"
)


class UnusedAutocastWarning(UserWarning):
    """An enabled ``fc.autocast`` exited without any fastcast layer having run inside it."""


def _checked(enabled: Any, misplaced: tuple, recipe: Any, calibrating: Any) -> Recipe:
    """The constructor's arguments checked (a TypeError naming the problem); the recipe,
    the default one for None."""
    if misplaced:
        raise TypeError(
            f"fc.autocast: recipe and the arguments after it are keyword-only: write "
            f"fc.autocast({enabled!r}, recipe=...), got {len(misplaced)} more positional "
            f"argument(s): {', '.join(map(repr, misplaced))}"
        )
    if enabled.__class__ is not bool:
        raise TypeError(
            f"fc.autocast: enabled must be a bool, got {enabled!r} (arguments after "
            "enabled are keyword-only: fc.autocast(recipe=...))"
        )
    if calibrating.__class__ is not bool:
        raise TypeError(f"fc.autocast: calibrating must be a bool, got {calibrating!r}")
    if recipe is None:
        recipe = default_recipe()
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"fc.autocast: recipe must be a fastcast recipe, got {recipe!r}")
    _recipe_types.add(type(recipe))
    return recipe


def _ran_nothing(below: Stack, stacklevel: int = 3) -> None:
    """Warn when the outermost enabled autocast saw no fastcast layer run: the model was
    most likely never converted (``fc.convert``), so it ran exactly in high precision.
    ``stacklevel``: of the user's ``with`` line (the C ``__exit__`` has no frame)."""
    if any(frame.enabled for frame in frames(below)):
        return  # an enabled level below decides when it exits
    autocast_state.warning_due = False  # once per process: one cause, one warning
    warnings.warn(
        "fc.autocast was enabled but no fastcast layer ran inside it, so nothing ran in "
        "FP8/FP4: convert the model first (model = fc.convert(model)), or check that the "
        "converted model is the one called inside the block",
        UnusedAutocastWarning,
        stacklevel=stacklevel,
    )


def _levels_exited(frame: AutocastFrame, below: Stack, ok: bool) -> None:
    """Tell the stateful schemes (delayed scaling) of this thread that ``frame`` exited
    (``ok``: without an exception); they decide whether it ends the step."""
    for scheme_state in thread_state().schemes.values():
        scheme_state.frame_exited(frame, below, ok)


class autocast(AutocastFrame):  # noqa: N801 - lower case like torch.autocast
    """Run the ``fc.Linear`` modules inside the block with ``recipe``.

    - ``enabled=False`` runs them in high precision (``recipe`` is still reported).
    - ``recipe=None`` uses the best recipe this machine runs, built once per process.
    - ``calibrating=True`` with ``enabled=False``: high precision, but delayed-scaling
      modules record amaxes, so that FP8 training starts from calibrated scales.
    - ``amax_reduction_group``: a process group over which delayed-scaling amaxes (and
      current-scaling activation/gradient amaxes) are max-reduced.

    Arguments after ``enabled`` are keyword-only and checked here: a wrong type is a
    TypeError at construction. Entering raises RuntimeError if ``recipe`` cannot run on
    this machine.

    Nests to any depth (the innermost wins) and restores the previous state exactly on
    exit, exceptions included. The state is per context (``contextvars``): per thread
    and per asyncio task, inherited by ``asyncio.to_thread`` and ``copy_context().run``,
    never leaking back from them. An instance may be entered again once it has exited,
    and be active in several threads or tasks at once; entering it while it is active in
    the same context raises; exiting a level that is not the innermost raises and exits
    the levels above it too. Usable as a decorator.
    """

    # No slots of its own: entering stores nothing in the instance, so one instance can be
    # active in several threads or tasks at once without any race.
    __slots__ = ()

    def __init__(
        self,
        enabled: bool = True,
        *misplaced: Any,
        recipe: Recipe | None = None,
        calibrating: bool = False,
        amax_reduction_group: Any = None,
    ) -> None:
        # One test for the usual call; _checked explains anything else.
        if (
            misplaced
            or enabled.__class__ is not bool
            or calibrating.__class__ is not bool
            or recipe.__class__ not in _recipe_types
        ):
            recipe = _checked(enabled, misplaced, recipe, calibrating)
        self.enabled = enabled
        self.recipe = recipe
        self.calibrating = calibrating
        self.group = amax_reduction_group
        self.ran = False

    def __enter__(self) -> autocast:
        opened = _begin("fastcast.autocast.enter") if _observers else None  # observer point
        try:
            below = get_stack()
            if self.recipe.__class__ not in _runnable:
                self._check_recipe()
            if below[1] is not None:  # nested: refuse this instance if it is already below
                self._refuse_reentry(below)
            node = [self, below, None]
            node[2] = set_stack(node)  # the token that restores ``below`` (see state.Stack)
            return self
        finally:
            if opened is not None:
                _end(opened)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        opened = _begin("fastcast.autocast.exit") if _observers else None  # observer point
        try:
            node = get_stack()
            if node[0] is not self:
                node = self._exit_out_of_order(node)  # raises once the stack is repaired
            try:
                reset_stack(node[2])
            except ValueError:  # the token belongs to another context
                raise RuntimeError(_NOT_HERE) from None
            below = node[1]
            if not self.ran:
                if self.enabled and autocast_state.warning_due:
                    _ran_nothing(below)
            elif below[1] is not None:  # nested: what ran here ran inside the levels below
                below[0].ran = True
            # Stateful schemes (delayed scaling) decide whether this level ends the step.
            # The stack is restored already: an error raised here leaves no level active.
            if autocast_state.stateful_threads:
                _levels_exited(self, below, exc_type is None)
        finally:
            if opened is not None:
                _end(opened)

    def _check_recipe(self) -> None:
        # A recipe type this machine cannot run raises when enabled (a disabled level
        # runs nothing); one that can is remembered, so the next entry pays a set look-up.
        recipe = self.recipe
        ok, why = scheme_for(recipe).support(default_device_type())
        if ok:
            _runnable.add(type(recipe))
        elif self.enabled:
            raise RuntimeError(f"{type(recipe).__name__} cannot run here: {why}")

    def _refuse_reentry(self, below: Stack) -> None:
        node = below
        while node is not None:
            if node[0] is self:
                raise RuntimeError(
                    "this fc.autocast instance is already active here; create a new one"
                )
            node = node[1]

    def _exit_out_of_order(self, stack: Stack) -> Stack:
        """Exit of a level that is not the innermost one: exit the levels above it with
        it (its token restores the stack below it), then raise."""
        node = stack
        while node is not None and node[0] is not self:
            node = node[1]
        if node is None:
            raise RuntimeError(_NOT_HERE)
        try:
            reset_stack(node[2])
        except ValueError:
            raise RuntimeError(_NOT_HERE) from None
        inner = []
        while stack is not node:
            inner.append(repr(stack[0].recipe))
            stack = stack[1]
        raise RuntimeError(
            "fc.autocast exited out of order: autocasts entered after it were still "
            f"active and have been exited with it (innermost first: {', '.join(inner)})"
        )

    def __call__(self, fn: F) -> F:
        """Decorate ``fn`` so that every call runs inside a fresh autocast like this one."""
        kwargs = {
            "recipe": self.recipe,
            "calibrating": self.calibrating,
            "amax_reduction_group": self.group,
        }
        enabled = self.enabled

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with autocast(enabled, **kwargs):
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (
            f"fc.autocast(enabled={self.enabled}, recipe={self.recipe!r}, "
            f"calibrating={self.calibrating}, amax_reduction_group={self.group!r})"
        )


class NativeAutocast(autocast):
    """``fc.autocast`` as the usual call makes it: ``__enter__`` and ``__exit__`` in C
    (``fastcast/runtime/_native.c``), step for step the methods of ``autocast`` above,
    which stay the reference (and run in their place while an observer is attached).
    Calling ``fc.autocast`` with the usual arguments builds one of these in C; any other
    call, ``torch.compile``'s tracing included, builds a plain ``autocast``."""

    __slots__ = ()
    if _native is not None:
        __enter__ = _native.enter
        __exit__ = _native.exit


def native_contract() -> tuple[tuple[str, Any], ...]:
    """Everything the C methods use, by role, in the order ``_native.ROLES`` names them:
    objects, never names looked up at run time (slots by their member descriptors, the
    keyword names from ``autocast.__init__``). ``_native.install`` refuses a table whose
    roles differ from its own; tests/runtime/test_native_autocast.py checks both sides."""
    frame, shared = AutocastFrame.__dict__, type(autocast_state).__dict__
    return (
        ("class", autocast),
        ("native", NativeAutocast),
        ("stack", _state_stack),
        ("default_recipe", default_recipe),
        ("shared", autocast_state),
        ("runnable", autocast_state.runnable),
        ("recipe_types", autocast_state.recipe_types),
        ("observers", _observers),
        ("slot_enabled", frame["enabled"]),
        ("slot_recipe", frame["recipe"]),
        ("slot_calibrating", frame["calibrating"]),
        ("slot_group", frame["group"]),
        ("slot_ran", frame["ran"]),
        ("slot_warning_due", shared["warning_due"]),
        ("slot_stateful_threads", shared["stateful_threads"]),
        ("keywords", KEYWORDS),
        ("py_enter", autocast.__dict__["__enter__"]),
        ("py_exit", autocast.__dict__["__exit__"]),
        ("check_recipe", autocast._check_recipe),
        ("refuse_reentry", autocast._refuse_reentry),
        ("exit_out_of_order", autocast._exit_out_of_order),
        ("ran_nothing", _ran_nothing),
        ("levels_exited", _levels_exited),
        ("not_here", _NOT_HERE),
    )


# autocast.__init__'s parameters the C construction takes by keyword: (enabled, recipe,
# calibrating, amax_reduction_group); the test checks them against the signature.
KEYWORDS = ("enabled", "recipe", "calibrating", "amax_reduction_group")

if _native is not None:
    _native.install(native_contract())
