"""GEMM families: how quantized operands carry their scales, which decides the kernel.

Per-tensor (``TENSORWISE``, the block ``WHOLE``), per-row (``ROWWISE``), 1x128/128x128
blocks (``BLOCKWISE``), ``MXFP8`` and ``NVFP4``; ``block_family`` names the family of an
FP8 layout from its scale block.
"""

from __future__ import annotations

WHOLE = (0, 0)  # the block of per-tensor scaling: one scale for the whole tensor

# GEMM families: how the operands carry their scales, which decides the GEMM kernel.
TENSORWISE = "tensorwise"
ROWWISE = "rowwise"
BLOCKWISE = "blockwise"
MXFP8 = "mxfp8"
NVFP4 = "nvfp4"
FAMILIES = (TENSORWISE, ROWWISE, BLOCKWISE, MXFP8, NVFP4)


def block_family(block: tuple[int, int]) -> str:
    """The GEMM family of an FP8 layout with FP32 scales over ``block``."""
    if block == WHOLE:
        return TENSORWISE
    if block == (1, 0):
        return ROWWISE
    return BLOCKWISE
