"""Schemes: what each recipe type means (see ``base.Scheme``). Importing this package
registers every scheme module in it: a new recipe's scheme is a new file here, with no
list to edit."""

from __future__ import annotations

import functools
import importlib
import pkgutil

import torch

from ..quantizers.base import ROLES
from ..recipe import DelayedScaling, MXFP8BlockScaling, Recipe
from ..runtime.hardware import cuda_capability, has_kernel, on_refresh
from ..tensor import MXFP8, QuantizedTensor
from .base import (
    DEFAULT_ALIGNMENT,
    ModuleState,
    Plan,
    Scheme,
    follow_device,
    recipe_support,
    register_scheme,
    reset_module_state,
    scheme_for,
)

__all__ = [
    "DEFAULT_ALIGNMENT",
    "ModuleState",
    "Plan",
    "Scheme",
    "default_recipe",
    "follow_device",
    "quantize",
    "recipe_support",
    "register_scheme",
    "reset_module_state",
    "scheme_for",
]


# Each scheme module registers its recipe type with @register_scheme when imported.
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")


@functools.cache
def default_recipe() -> Recipe:
    """The best recipe this machine runs natively, built once per process."""
    cap = cuda_capability()
    if cap is not None and cap >= (10, 0) and has_kernel("cuda", MXFP8):
        return MXFP8BlockScaling()
    return DelayedScaling()


on_refresh(default_recipe.cache_clear)


def quantize(
    tensor: torch.Tensor,
    recipe: Recipe,
    role: str = "input",
    *,
    rowwise: bool = True,
    columnwise: bool = False,
) -> QuantizedTensor:
    """Quantize ``tensor`` as ``recipe`` does for ``role``; ``.dequantize()`` undoes it."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    quantizer = scheme_for(recipe).quantizer(recipe, role)
    return quantizer.quantize(tensor, rowwise=rowwise, columnwise=columnwise)
