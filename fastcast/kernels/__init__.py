"""Fused quantize kernels (C++ operators, built on first use) and the choice between
them and the PyTorch reference (``choice``)."""

from .choice import MODES, fused_op, kernels_mode, refresh, tensorwise_op

__all__ = ["MODES", "fused_op", "kernels_mode", "refresh", "tensorwise_op"]
