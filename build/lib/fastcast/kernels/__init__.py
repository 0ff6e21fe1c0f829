"""Fused quantize kernels: C++ operators on the CPU (``build``, built on first use), the
reference math compiled by Inductor on CUDA (``compiled``: Triton kernels, compiled on
first use and cached on disk), and the choice between them and the PyTorch reference
(``choice``, ``FASTCAST_KERNELS``)."""

from .choice import MODES, fused_op, kernels_mode, refresh, tensorwise_op

__all__ = ["MODES", "fused_op", "kernels_mode", "refresh", "tensorwise_op"]
