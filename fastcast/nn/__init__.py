"""Modules: ``fc.Linear``, ``fc.Conv1D`` and ``fc.convert``."""

from .conv1d import Conv1D
from .convert import convert, keep_high_precision
from .grouped import GroupedLinear
from .linear import Linear

__all__ = ["Conv1D", "GroupedLinear", "Linear", "convert", "keep_high_precision"]
