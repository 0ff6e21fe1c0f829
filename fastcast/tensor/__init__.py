"""Quantized tensor storage: data, dequantization scales, format and logical shape.

A quantized tensor holds up to two layouts of the same logical 2D matrix ``[R, K]``
(higher-rank tensors are viewed as ``[prod(leading), K]``):

- row-wise: ``data`` shaped like the tensor, scaled in blocks along the last dim,
- column-wise: ``data_t`` shaped ``[K, R]``, scaled in blocks along R,

because a GEMM contracts over the last dim of both operands (``a @ b.T``) and backward
contracts over the other dim. ``t()`` swaps the two, so ``scaled_mm(g, w.t())`` is dgrad.

Each layout's scales cover blocks of ``block = (rows, cols)`` elements, where 0 means
"the whole dimension": ``(0, 0)`` is one scale per tensor, ``(1, 0)`` one per row,
``(1, 128)`` 1x128 tiles, ``(128, 128)`` 128x128 tiles. A partial tile at the edge has
its own scale. Storage classes register under a stable name (``STORAGE``), so a later
codec can rebuild them by name.

Here: ``families.py`` (the GEMM families and scale blocks), ``base.py``
(``QuantizedTensor``: layouts, dequantization, transposition, flattening) and
``storages.py`` (FP8, MXFP8 and NVFP4 storage).
"""

from __future__ import annotations

from .base import STORAGE, QuantizedTensor, register_storage
from .families import BLOCKWISE, FAMILIES, MXFP8, NVFP4, ROWWISE, TENSORWISE, WHOLE, block_family
from .storages import Float8Tensor, MXFP8Tensor, NVFP4Tensor

__all__ = [
    "BLOCKWISE",
    "FAMILIES",
    "MXFP8",
    "NVFP4",
    "ROWWISE",
    "STORAGE",
    "TENSORWISE",
    "WHOLE",
    "Float8Tensor",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "QuantizedTensor",
    "block_family",
    "register_storage",
]
