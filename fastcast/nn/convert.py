"""``fc.convert``: swap ``nn.Linear`` layers for ``fc.Linear`` in place."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..recipe import MXFP8BlockScaling, NVFP4BlockScaling, Recipe
from .linear import Linear

# The FP8 tensor-core kernels need both GEMM dims of the weight to be multiples of 16.
DEFAULT_ALIGNMENT = 16


def required_alignment(recipe: Recipe | None) -> int:
    """What in/out features must be multiples of for ``recipe`` (block size or 16)."""
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8BlockScaling.BLOCK
    if isinstance(recipe, NVFP4BlockScaling):
        return NVFP4BlockScaling.BLOCK
    return DEFAULT_ALIGNMENT


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
    align = required_alignment(recipe)

    def eligible(child: nn.Module, name: str) -> bool:
        if type(child) is not nn.Linear:  # subclasses may override forward: leave them
            return False
        if child.in_features % align or child.out_features % align:
            return False
        return module_filter_fn is None or module_filter_fn(child, name)

    if eligible(module, ""):
        return _swap(module)
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if eligible(child, full):
                setattr(parent, child_name, _swap(child))
    return module


def _swap(linear: nn.Linear) -> Linear:
    new = Linear.__new__(Linear)
    nn.Module.__init__(new)
    new.in_features = linear.in_features
    new.out_features = linear.out_features
    new.register_parameter("weight", linear.weight)
    new.register_parameter("bias", linear.bias)  # a Parameter or None
    new._init_runtime()
    new.train(linear.training)
    # Hooks registered on the old layer keep working on the new one.
    for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                  "_backward_pre_hooks", "_forward_hooks_with_kwargs",
                  "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        if hasattr(linear, hooks):
            setattr(new, hooks, getattr(linear, hooks))
    return new
