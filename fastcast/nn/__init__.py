"""Modules: ``fc.Linear`` and ``fc.convert``."""

from .convert import convert
from .linear import Linear

__all__ = ["Linear", "convert"]
