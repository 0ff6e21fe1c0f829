"""The quantized storages: FP8 with FP32 scales, MXFP8 (E8M0 scales), NVFP4.

Each says how its codes and scales decode to FP32 and which GEMM family its layouts
belong to; NVFP4 adds its per-tensor scale and the Hadamard signs its layouts were
transformed with.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..kernels import fused_op
from ..reference.decode import decode_e8m0, unpack_e2m1
from ..reference.hadamard import transform_rows
from .base import QuantizedTensor, register_storage
from .families import MXFP8, NVFP4, block_family


@register_storage
class Float8Tensor(QuantizedTensor):
    """FP8 (E4M3/E5M2) elements with FP32 dequantization scales over blocks.

    Per-tensor, per-row, 1x128 and 128x128 scaling are all this class; ``block`` says
    which.
    """

    storage_name = "float8"
    __slots__ = ()

    @property
    def family(self) -> str:
        """Per-tensor, per-row or block-scaled: decided by the row-wise layout's block."""
        return block_family(self.block)


@register_storage
class MXFP8Tensor(QuantizedTensor):
    """OCP MXFP8: FP8 elements, one E8M0 scale (uint8 biased exponent) per 32 along K."""

    storage_name = "mxfp8"
    FAMILY = MXFP8
    __slots__ = ()

    def _decode_scales(self, scales: torch.Tensor) -> torch.Tensor:
        return decode_e8m0(scales)

    def _kernel_scales(self, scales: torch.Tensor) -> torch.Tensor:
        return scales  # the kernel decodes E8M0 itself


@register_storage
class NVFP4Tensor(QuantizedTensor):
    """NVFP4: E2M1 codes packed two per byte (first element in the low nibble), an E4M3
    scale per 16 elements, and an FP32 per-tensor scale (``global_scale_inv``).

    A layout may hold the random Hadamard transform of the matrix rather than the matrix
    (the weight-gradient operands, ``quantize.hadamard``): ``rht`` is then the sign vector
    of the transform of the row-wise layout along its last dim, ``rht_t`` that of the
    column-wise layout along R, whose tensor scale is ``global_scale_inv_t`` (the
    transform changes the amax). A GEMM of two operands transformed alike computes the
    product of the matrices; ``dequantize`` undoes the transform.
    """

    storage_name = "nvfp4"
    FAMILY = NVFP4
    inner_names = QuantizedTensor.inner_names + ("global_scale_inv", "global_scale_inv_t")
    __slots__ = ("global_scale_inv", "global_scale_inv_t", "rht", "rht_t")

    def __init__(
        self,
        *,
        global_scale_inv: torch.Tensor,
        global_scale_inv_t: torch.Tensor | None = None,
        rht: tuple[int, ...] | None = None,
        rht_t: tuple[int, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.global_scale_inv = global_scale_inv
        self.global_scale_inv_t = global_scale_inv_t
        self.rht, self.rht_t = rht, rht_t

    def _rows_cols(self, data: torch.Tensor) -> tuple[int, int]:
        return math.prod(data.shape[:-1]), data.shape[-1] * 2  # two codes per byte

    def _decode_data(self, data: torch.Tensor) -> torch.Tensor:
        return unpack_e2m1(data)

    def _decode_scales(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.float() * self.global_scale_inv.float()

    def _dequantize_layout(
        self, data: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
    ) -> torch.Tensor:
        op = fused_op("dequantize_nvfp4", data)
        global_scale_inv = self.global_scale_inv
        # One fused pass for one FP32 tensor scale (grouped operands hold one per group).
        fused = op is not None and global_scale_inv.dtype == torch.float32
        if fused and global_scale_inv.numel() == 1:
            rows, cols = self._rows_cols(data)
            return op(data.reshape(rows, cols // 2), scales, global_scale_inv, block[0])
        return super()._dequantize_layout(data, scales, block)

    # -- the column-wise layout's own tensor scale and transform ---------------------------
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.data is None:  # the column-wise layout, as an operand of its own
            out = self.columnwise_operand().dequantize(torch.float32)
            return out.t().reshape(self.shape).to(dtype)
        out = self._dequantize_layout(self.data, self.scale_inv, self.block)
        if self.rht is not None:
            out = transform_rows(out, self.rht, inverse=True)
        return out.reshape(self.shape).to(dtype)

    def t(self) -> QuantizedTensor:
        clone = super().t()
        clone.rht, clone.rht_t = self.rht_t, self.rht
        if self.global_scale_inv_t is not None:
            clone.global_scale_inv_t = self.global_scale_inv
            clone.global_scale_inv = self.global_scale_inv_t
        return clone

    def columnwise_operand(self) -> QuantizedTensor:
        clone = super().columnwise_operand()
        clone.rht, clone.rht_t = self.rht_t, None
        if self.global_scale_inv_t is not None:
            clone.global_scale_inv = self.global_scale_inv_t
        clone.global_scale_inv_t = None
        return clone

    def rowwise_operand(self) -> QuantizedTensor:
        clone = super().rowwise_operand()
        clone.global_scale_inv_t, clone.rht_t = None, None
        return clone

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        names, ctx = super().__tensor_flatten__()
        ctx["rht"], ctx["rht_t"] = self.rht, self.rht_t
        return names, ctx

    @classmethod
    def __tensor_unflatten__(
        cls,
        inner_tensors: dict[str, torch.Tensor],
        ctx: dict[str, Any],
        outer_size: Any = None,
        outer_stride: Any = None,
    ) -> QuantizedTensor:
        obj = super().__tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride)
        obj.rht, obj.rht_t = ctx.get("rht"), ctx.get("rht_t")
        return obj
