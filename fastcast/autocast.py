"""``fc.autocast``: the context manager that turns FP8 on for the modules inside it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .hardware import default_device_type
from .recipe import Recipe
from .schemes import default_recipe, scheme_for
from .state import AutocastFrame, ThreadState, get_thread_state, thread_state

F = TypeVar("F", bound=Callable[..., Any])


class autocast(AutocastFrame):  # noqa: N801 - lower case like torch.autocast
    """Run the ``fc.Linear`` modules inside the block with ``recipe``.

    - ``enabled=False`` runs them in high precision (``recipe`` is still reported).
    - ``recipe=None`` uses the best recipe this machine runs, built once per process.
    - ``calibrating=True`` with ``enabled=False``: high precision, but delayed-scaling
      modules record amaxes, so that FP8 training starts from calibrated scales.
    - ``amax_reduction_group``: a process group over which delayed-scaling amaxes (and
      current-scaling activation/gradient amaxes) are max-reduced.

    Nests to any depth (the innermost wins) and restores the previous state exactly on
    exit, exceptions included. An instance may be entered again once it has exited, but
    not while it is active. Usable as a decorator. Per thread: other threads never see
    it. Entering raises RuntimeError if ``recipe`` cannot run on this machine.
    """

    # All fields are AutocastFrame's slots: entering makes this object the thread's
    # current frame, so modules read the recipe with one attribute access.
    __slots__ = ()

    def __init__(
        self,
        enabled: bool = True,
        recipe: Recipe | None = None,
        calibrating: bool = False,
        amax_reduction_group: Any = None,
    ) -> None:
        self.enabled = enabled
        self.recipe = default_recipe() if recipe is None else recipe
        self.calibrating = calibrating
        self.group = amax_reduction_group
        self._prev = None

    def __enter__(self) -> autocast:
        if self._prev is not None:
            raise RuntimeError("this fc.autocast instance is already active; create a new one")
        try:
            ts = get_thread_state()
        except LookupError:  # this thread's first autocast
            ts = thread_state()
        recipe = self.recipe
        if recipe is not ts.last_good_recipe and recipe is not ts.other_good_recipe:
            self._check_recipe(ts)
        self._ts = ts
        self._prev = ts.frame
        ts.frame = self
        return self

    def _check_recipe(self, ts: ThreadState) -> None:
        # Raises for a non-recipe, or for a recipe this machine cannot run when enabled
        # (a disabled level runs nothing). The last two recipes that passed are remembered
        # per thread, so a loop over one recipe (or an outer and an inner one) pays an
        # identity test, not a look-up.
        recipe = self.recipe
        ok, why = scheme_for(recipe).support(default_device_type())
        if not ok:
            if self.enabled:
                raise RuntimeError(f"{type(recipe).__name__} cannot run here: {why}")
            return
        ts.other_good_recipe = ts.last_good_recipe
        ts.last_good_recipe = recipe

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        ts = self._ts
        ts.frame = self._prev
        # Stateful schemes (delayed scaling) decide whether this level ends the step.
        if ts.schemes:
            for scheme_state in ts.schemes.values():
                scheme_state.frame_exited(self, exc_type is None)
        self._prev = None

    def __call__(self, fn: F) -> F:
        """Decorate ``fn`` so that every call runs inside a fresh autocast like this one."""
        args = (self.enabled, self.recipe, self.calibrating, self.group)

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with autocast(*args):
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]
