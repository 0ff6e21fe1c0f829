"""fastcast: FP8 and FP4 mixed precision for PyTorch training with almost no CPU overhead."""

from .autocast import autocast
from .hardware import (
    fp8_available,
    fp8_block_scaling_available,
    mxfp8_available,
    nvfp4_available,
)
from .recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from .state import get_autocast_recipe, is_autocast_enabled

__version__ = "0.1.0"

__all__ = [
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
    "autocast",
    "fp8_available",
    "fp8_block_scaling_available",
    "get_autocast_recipe",
    "is_autocast_enabled",
    "mxfp8_available",
    "nvfp4_available",
]
