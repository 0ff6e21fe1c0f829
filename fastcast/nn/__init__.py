"""Modules: ``fc.Linear`` and ``fc.convert``."""

from .convert import convert, keep_high_precision
from .grouped import GroupedLinear
from .linear import Linear

__all__ = ["GroupedLinear", "Linear", "convert", "keep_high_precision"]
