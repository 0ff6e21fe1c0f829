"""``fc.convert(model, autocast=True)``: the model runs its own forward under ``fc.autocast``.

Trainers (Hugging Face ``Trainer``, Lightning, accelerate) call ``model(...)`` themselves,
so no ``with fc.autocast(...)`` block can be put around the forward. Instead the model's
``forward`` instance attribute becomes an ``AutocastForward``, which enters a fresh
``fc.autocast(recipe=...)`` around the forward the model had (or one like the
``fc.autocast`` given as ``autocast=``: its process group, calibration), unless the caller
is already inside an ``fc.autocast``: that one then decides (``fc.autocast(enabled=False)``
around an evaluation still runs it in high precision).

Why this shape:

- a ``with`` block inside the call restores the autocast stack exactly when the forward
  raises; a forward pre-hook that enters and a forward hook that exits split one level
  across two calls, which an exception between them (in the forward, or in another
  hook) can leave entered;
- nothing is stored per call (the autocast state is per context: thread, asyncio task), so
  threads may call the model at once;
- an attribute that is no parameter, buffer or module leaves the state dict alone, and the
  class is unchanged (a generated subclass would change ``type(model)``, which code
  compares and Hugging Face names in ``config.json``, and could not be pickled by
  reference);
- it looks like a bound method to code that inspects ``model.forward``: ``__func__`` and
  ``__self__`` (accelerate's ``prepare`` rebinds ``__func__`` under its own
  ``torch.autocast``, and its unwrap rebinds what it finds), and ``__signature__`` (the
  forward's own, which Hugging Face's ``Trainer`` reads to keep the dataset columns the
  forward takes). Unlike a bound method, which pickles as a look-up of ``forward`` on a
  model whose state is not restored yet, it pickles and deep-copies with its model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ..autocast import autocast as fc_autocast
from ..recipe import Recipe
from ..runtime.state import get_stack


class AutocastFunction:
    """``function(module, ...)`` inside a fresh ``fc.autocast(enabled, recipe=recipe,
    calibrating=calibrating, amax_reduction_group=group)`` when no ``fc.autocast`` is
    active, as is otherwise. Holds no module: what ``__func__`` of a bound method is,
    shareable between a model and its copies."""

    __slots__ = ("enabled", "recipe", "calibrating", "group", "function")

    def __init__(self, template: fc_autocast, function: Callable[..., Any]) -> None:
        self.enabled = template.enabled
        self.recipe = template.recipe
        self.calibrating = template.calibrating
        self.group = template.group
        self.function = function

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if get_stack()[1] is not None:  # an fc.autocast is active: it decides
            return self.function(module, *args, **kwargs)
        with self.autocast():
            return self.function(module, *args, **kwargs)

    def autocast(self) -> fc_autocast:
        """A fresh ``fc.autocast`` with this function's arguments."""
        return fc_autocast(
            self.enabled,
            recipe=self.recipe,
            calibrating=self.calibrating,
            amax_reduction_group=self.group,
        )

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.function)

    @property
    def __name__(self) -> str:  # noqa: PLE0307 - read by functools.wraps and pickle
        return getattr(self.function, "__name__", "forward")

    def __reduce__(self) -> tuple:
        if self.group is not None:
            raise TypeError(
                "fastcast: a model converted with autocast=fc.autocast(amax_reduction_group"
                "=...) cannot be copied or pickled (a process group cannot); copy or save "
                "its state dict, or convert the copy again"
            )
        return (_rebuild, (self.enabled, self.recipe, self.calibrating, self.function))

    def __repr__(self) -> str:
        return f"<{self.autocast()!r} around {self.function!r}>"


def _rebuild(
    enabled: bool, recipe: Recipe, calibrating: bool, function: Callable[..., Any]
) -> AutocastFunction:
    template = fc_autocast(enabled, recipe=recipe, calibrating=calibrating)
    return AutocastFunction(template, function)


class AutocastForward:
    """The ``forward`` attribute of a model converted with ``autocast=``: an
    ``AutocastFunction`` bound to the model."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, function: AutocastFunction, module: nn.Module) -> None:
        self.__func__ = function
        self.__self__ = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # AutocastFunction.__call__, inlined: this runs on every call of the model.
        bound = self.__func__
        if get_stack()[1] is not None:
            return bound.function(self.__self__, *args, **kwargs)
        with fc_autocast(
            bound.enabled,
            recipe=bound.recipe,
            calibrating=bound.calibrating,
            amax_reduction_group=bound.group,
        ):
            return bound.function(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        sig = inspect.signature(self.__func__.function)
        return sig.replace(parameters=list(sig.parameters.values())[1:])  # less the module

    @property
    def __name__(self) -> str:  # noqa: PLE0307
        return self.__func__.__name__

    def __reduce__(self) -> tuple:
        return (AutocastForward, (self.__func__, self.__self__))

    def __repr__(self) -> str:
        return f"<forward of {type(self.__self__).__name__} in {self.__func__.autocast()!r}>"


def autocast_function(
    module: nn.Module, autocast: Any, recipe: Recipe | None
) -> AutocastFunction | None:
    """What ``fc.convert(module, recipe=recipe, autocast=autocast)`` makes ``module``'s
    forward: None for ``autocast=False``; for True, the forward the module had (its
    class's, or the method its ``forward`` attribute binds; a previous ``autocast=``'s is
    replaced) in ``fc.autocast(recipe=recipe)``; for an ``fc.autocast``, in one like it.
    Raises, before anything changes, for any other ``autocast``, an ``fc.autocast`` whose
    recipe is not ``recipe``, and a ``forward`` attribute that is no method of ``module``
    (``torch.compile``'s or a wrapper's)."""
    if autocast is False:
        return None
    if autocast is True:
        template = fc_autocast(recipe=recipe)
    elif isinstance(autocast, fc_autocast):
        template = autocast
        if recipe is not None and autocast.recipe != recipe:
            raise ValueError(
                f"fastcast.convert: autocast={autocast!r} runs another recipe than "
                f"recipe={recipe!r}; give both the same one"
            )
    else:
        raise TypeError(
            f"fastcast.convert: autocast must be a bool or an fc.autocast, got {autocast!r}"
        )
    return AutocastFunction(template, _forward_of(module))


def _forward_of(module: nn.Module) -> Callable[..., Any]:
    current = module.__dict__.get("forward")
    if current is None:
        return type(module).forward
    if isinstance(current, AutocastForward):
        return current.__func__.function
    if getattr(current, "__self__", None) is module and hasattr(current, "__func__"):
        return current.__func__  # a method bound to the module as an attribute (accelerate)
    raise ValueError(
        f"fastcast.convert(autocast=...): {type(module).__name__}.forward was replaced by "
        f"{current!r}, which is not a method of the module; convert with autocast= before "
        "wrapping the model or replacing its forward (torch.compile, accelerate's "
        "prepare), or convert the module that holds the layers"
    )


def wrap_forward(module: nn.Module, function: AutocastFunction | None) -> None:
    """Make ``module(...)`` run ``function`` (``autocast_function``'s answer); nothing
    when it is None."""
    if function is not None:
        module.forward = AutocastForward(function, module)
