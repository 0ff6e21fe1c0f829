"""fastcast: FP8 and FP4 mixed precision for PyTorch training with almost no CPU overhead."""

from . import profiling
from ._on_import import register_when_dynamo_imported
from .autocast import autocast
from .gemm import scaled_mm
from .gemm_grouped import grouped_mm
from .nn import Conv1D, GroupedLinear, Linear, convert, keep_high_precision
from .numerics import inspect
from .recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from .runtime.hardware import (
    fp8_available,
    fp8_block_scaling_available,
    fp8_rowwise_available,
    mxfp8_available,
    nvfp4_available,
)
from .runtime.state import get_autocast_recipe, is_autocast_enabled
from .schemes import quantize
from .serialization.extra_state import (
    allow_unsafe_extra_state,
    read_extra_state,
    strip_extra_state,
)
from .tensor import QuantizedTensor

__version__ = "0.1.0"

register_when_dynamo_imported()  # torch.compile support (fastcast.compile), imported lazily
if profiling.ENV_ENABLED:  # FASTCAST_NVTX=1: every module is imported, wrap them now
    profiling.enable()

__all__ = [
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8RowwiseScaling",
    "Format",
    "Conv1D",
    "GroupedLinear",
    "Linear",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QuantizedTensor",
    "Recipe",
    "allow_unsafe_extra_state",
    "autocast",
    "convert",
    "fp8_available",
    "fp8_block_scaling_available",
    "fp8_rowwise_available",
    "get_autocast_recipe",
    "grouped_mm",
    "inspect",
    "is_autocast_enabled",
    "keep_high_precision",
    "mxfp8_available",
    "nvfp4_available",
    "profiling",
    "quantize",
    "read_extra_state",
    "scaled_mm",
    "strip_extra_state",
]
