"""Quantizers, one module per scaling family, and the recipe -> quantizer mapping."""

from __future__ import annotations

from typing import Any

import torch

from ..recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from ..tensor import QuantizedTensor
from .base import ROLES, Quantizer
from .block import BlockScalingQuantizer
from .mx import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer
from .tensorwise import CurrentScalingQuantizer, DelayedScalingQuantizer, FixedScaleQuantizer

__all__ = [
    "ROLES",
    "BlockScalingQuantizer",
    "CurrentScalingQuantizer",
    "DelayedScalingQuantizer",
    "FixedScaleQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "Quantizer",
    "quantize",
    "stateless_quantizers",
]


def _role_format(recipe: Any, role: str) -> str:
    fmt = recipe.fp8_format
    return fmt.bwd if role == "grad_output" else fmt.fwd


def stateless_quantizer(recipe: Recipe, role: str, group: Any = None) -> Quantizer:
    """The quantizer ``recipe`` uses for ``role`` (input, weight or grad_output).

    ``group`` reduces per-tensor amaxes of activations and gradients over ranks
    (current scaling under sequence/tensor parallelism). Delayed scaling has state and
    lives in the modules; asking for it here is an error.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if isinstance(recipe, Float8CurrentScaling):
        return CurrentScalingQuantizer(
            fmt=_role_format(recipe, role),
            power_2_scales=recipe.use_power_2_scales,
            amax_epsilon=recipe.amax_epsilon,
            amax_reduction_group=None if role == "weight" else group,
        )
    if isinstance(recipe, Float8BlockScaling):
        dims = {
            "input": recipe.x_block_scaling_dim,
            "weight": recipe.w_block_scaling_dim,
            "grad_output": recipe.grad_block_scaling_dim,
        }
        return BlockScalingQuantizer(
            fmt=_role_format(recipe, role),
            block_dim=dims[role],
            power_2_scales=not recipe.use_f32_scales,
        )
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8Quantizer(fmt=_role_format(recipe, role))
    if isinstance(recipe, NVFP4BlockScaling):
        return NVFP4Quantizer(
            block_2d=role == "weight" and recipe.weight_2d_blocks,
            stochastic_rounding=role == "grad_output" and recipe.stochastic_rounding,
        )
    if isinstance(recipe, CustomRecipe):
        quantizer = recipe.qfactory(role)
        if not callable(getattr(quantizer, "quantize", None)):
            raise TypeError(
                f"CustomRecipe.qfactory({role!r}) returned {type(quantizer).__name__}, "
                "which has no quantize(x, rowwise=..., columnwise=...) method"
            )
        return quantizer
    if isinstance(recipe, DelayedScaling):
        raise ValueError(
            "DelayedScaling is stateful (its scales come from an amax history): quantize "
            "through fc.Linear under fc.autocast, or use Float8CurrentScaling"
        )
    raise TypeError(f"recipe must be a fastcast recipe, got {type(recipe).__name__}")


def stateless_quantizers(recipe: Recipe, group: Any = None) -> tuple[Quantizer, ...]:
    """``(input, weight, grad_output)`` quantizers of a stateless recipe."""
    return tuple(stateless_quantizer(recipe, role, group) for role in ROLES)


def quantize(
    tensor: torch.Tensor,
    recipe: Recipe,
    role: str = "input",
    *,
    rowwise: bool = True,
    columnwise: bool = False,
) -> QuantizedTensor:
    """Quantize ``tensor`` as ``recipe`` does for ``role``; ``.dequantize()`` undoes it."""
    return stateless_quantizer(recipe, role).quantize(
        tensor, rowwise=rowwise, columnwise=columnwise
    )
