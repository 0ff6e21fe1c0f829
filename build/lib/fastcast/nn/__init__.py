"""Modules: ``fc.Linear`` and ``fc.convert``."""

from .convert import convert, keep_high_precision
from .linear import Linear

__all__ = ["Linear", "convert", "keep_high_precision"]
