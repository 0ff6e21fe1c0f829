"""``fc.convert``: swap ``nn.Linear`` layers for ``fc.Linear`` in place."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..recipe import Recipe
from ..schemes import DEFAULT_ALIGNMENT, scheme_for
from .linear import Linear


def convert(
    module: nn.Module,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    recipe: Recipe | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` below ``module`` by an ``fc.Linear`` sharing its
    parameters (not copies), and return ``module``.

    ``module_filter_fn(linear, fully_qualified_name)`` returning False keeps a layer.
    Layers whose features are not multiples of the recipe's block (32 for MXFP8, 16
    otherwise) are kept as they are, since their GEMMs could not run quantized.
    A bare ``nn.Linear`` passed as ``module`` is converted and returned.
    """
    align = DEFAULT_ALIGNMENT if recipe is None else scheme_for(recipe).alignment(recipe)

    def eligible(child: nn.Module, name: str) -> bool:
        if type(child) is not nn.Linear:  # subclasses may override forward: leave them
            return False
        if child.in_features % align or child.out_features % align:
            return False
        return module_filter_fn is None or module_filter_fn(child, name)

    if eligible(module, ""):
        return _swap(module)
    # One replacement per layer object: a layer registered under two parents (weight
    # tying, shared blocks) stays one module with one set of scales.
    swapped: dict[int, Linear] = {}
    for name, parent in list(module.named_modules(remove_duplicate=False)):
        # _modules, not named_children(), which would hide the second entry of a layer.
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            full = f"{name}.{child_name}" if name else child_name
            if id(child) in swapped:
                setattr(parent, child_name, swapped[id(child)])
            elif eligible(child, full):
                swapped[id(child)] = _swap(child)
                setattr(parent, child_name, swapped[id(child)])
    return module


def _swap(linear: nn.Linear) -> Linear:
    """An fc.Linear with everything the layer had: the same Parameter objects, buffers,
    hooks, training flag and any attribute a user set on it."""
    new = Linear.__new__(Linear)
    # The very containers, not copies: hook handles the user holds keep working (they
    # remove from the dict they were registered in). The old layer is being replaced.
    new.__dict__.update(linear.__dict__)
    new._init_runtime()
    return new
