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
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from .formats import FP8_DTYPES
from .kernels import fused_op
from .reference.decode import apply_scales, decode_e8m0, unpack_e2m1

STORAGE: dict[str, type[QuantizedTensor]] = {}

_FP8_CODES = frozenset(FP8_DTYPES.values())

WHOLE = (0, 0)  # the block of per-tensor scaling: one scale for the whole tensor

# GEMM families: how the operands carry their scales, which decides the GEMM kernel.
TENSORWISE = "tensorwise"
ROWWISE = "rowwise"
BLOCKWISE = "blockwise"
MXFP8 = "mxfp8"
NVFP4 = "nvfp4"
FAMILIES = (TENSORWISE, ROWWISE, BLOCKWISE, MXFP8, NVFP4)


def register_storage(cls: type[QuantizedTensor]) -> type[QuantizedTensor]:
    """Class decorator: make ``cls`` rebuildable from its ``storage_name``."""
    name = cls.storage_name
    if name in STORAGE and STORAGE[name] is not cls:
        raise ValueError(f"storage name {name!r} is already registered to {STORAGE[name]}")
    STORAGE[name] = cls
    return cls


class QuantizedTensor:
    """Base storage: subclasses say how data and scales decode to FP32."""

    storage_name: ClassVar[str]
    # The GEMM family (one of FAMILIES) when it is the same for every layout of the class.
    FAMILY: ClassVar[str]
    # Tensor-valued attributes, in flatten order; any of them may be None.
    inner_names: ClassVar[tuple[str, ...]] = ("data", "scale_inv", "data_t", "scale_inv_t")

    __slots__ = (
        "data",
        "scale_inv",
        "data_t",
        "scale_inv_t",
        "block",
        "block_t",
        "fmt",
        "shape",
        "dtype",
    )

    def __init__(
        self,
        *,
        fmt: str,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        data: torch.Tensor | None = None,
        scale_inv: torch.Tensor | None = None,
        block: tuple[int, int] = (0, 0),
        data_t: torch.Tensor | None = None,
        scale_inv_t: torch.Tensor | None = None,
        block_t: tuple[int, int] = (0, 0),
    ) -> None:
        if data is None and data_t is None:
            raise ValueError("a quantized tensor needs row-wise or column-wise data")
        self.data = data
        self.scale_inv = scale_inv
        # (Converted only when needed: quantizers pass tuples and torch.Size, per call.)
        self.block = block if type(block) is tuple else tuple(block)
        self.data_t = data_t
        self.scale_inv_t = scale_inv_t
        self.block_t = block_t if type(block_t) is tuple else tuple(block_t)
        self.fmt = fmt
        self.shape = shape if type(shape) is torch.Size else torch.Size(shape)
        self.dtype = dtype

    @classmethod
    def assemble(
        cls,
        fmt: str,
        shape: torch.Size,
        dtype: torch.dtype,
        data: torch.Tensor | None,
        scale_inv: torch.Tensor | None,
        block: tuple[int, int],
        data_t: torch.Tensor | None,
        scale_inv_t: torch.Tensor | None,
        block_t: tuple[int, int],
    ) -> QuantizedTensor:
        """The constructor of quantizers' hot paths: positional, fields stored as given
        (a ``torch.Size``, tuples), nothing converted or checked; a third of what the
        keyword constructor costs. For classes with no slots of their own."""
        if cls._extra_slot_names:
            raise TypeError(f"{cls.__name__} has fields of its own: use its constructor")
        obj = object.__new__(cls)
        obj.data, obj.scale_inv, obj.block = data, scale_inv, block
        obj.data_t, obj.scale_inv_t, obj.block_t = data_t, scale_inv_t, block_t
        obj.fmt, obj.shape, obj.dtype = fmt, shape, dtype
        return obj

    # -- decoding: what a subclass defines --------------------------------------------
    def _decode_data(self, data: torch.Tensor) -> torch.Tensor:
        """Element values of ``data`` as FP32, same shape (before scaling)."""
        return data.float()

    def _decode_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """Dequantization multipliers as FP32."""
        return scales.float()

    def _kernel_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """The scales as the fused dequantization takes them: FP32, or E8M0 bytes."""
        return self._decode_scales(scales)

    def _rows_cols(self, data: torch.Tensor) -> tuple[int, int]:
        shape = data.shape
        if len(shape) == 2:
            return shape[0], shape[1]
        return math.prod(shape[:-1]), shape[-1]

    # -- public --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return (self.data if self.data is not None else self.data_t).device

    @property
    def family(self) -> str:
        """The GEMM family (one of ``FAMILIES``) of the row-wise layout."""
        return self.FAMILY

    @property
    def has_rowwise(self) -> bool:
        return self.data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.data_t is not None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision tensor this represents, in ``dtype`` (default: original)."""
        dtype = dtype or self.dtype
        if self.data is not None:
            out = self._dequantize_layout(self.data, self.scale_inv, self.block)
            return out.reshape(self.shape).to(dtype)
        out = self._dequantize_layout(self.data_t, self.scale_inv_t, self.block_t)
        return out.t().reshape(self.shape).to(dtype)

    def dequantize_rowwise_2d(self) -> torch.Tensor:
        """The row-wise layout as an FP32 ``[R, K]`` matrix (the GEMM emulation operand)."""
        if self.data is None:
            raise ValueError(
                f"{type(self).__name__} of shape {tuple(self.shape)} has no row-wise data; "
                "quantize it with rowwise=True"
            )
        return self._dequantize_layout(self.data, self.scale_inv, self.block)

    def _dequantize_layout(
        self, data: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
    ) -> torch.Tensor:
        rows, cols = self._rows_cols(data)
        if data.dtype in _FP8_CODES:  # FP8 elements: one fused pass where there is one
            op = fused_op("dequantize_blocks", data)
            if op is not None:
                return op(data.reshape(rows, cols), self._kernel_scales(scales), *block)
        values = self._decode_data(data).reshape(rows, cols)
        return apply_scales(values, self._decode_scales(scales), block)

    def t(self) -> QuantizedTensor:
        """The transposed matrix: the column-wise layout becomes the row-wise one."""
        if len(self.shape) != 2:
            raise ValueError(f"t() needs a 2D quantized tensor, this one is {tuple(self.shape)}")
        if self.data_t is None:
            raise ValueError(
                f"{type(self).__name__} of shape {tuple(self.shape)} has no column-wise data; "
                "quantize it with columnwise=True"
            )
        clone = self._clone_meta()
        clone.data, clone.data_t = self.data_t, self.data
        clone.scale_inv, clone.scale_inv_t = self.scale_inv_t, self.scale_inv
        clone.block, clone.block_t = self.block_t, self.block
        clone.shape = torch.Size((self.shape[1], self.shape[0]))
        return clone

    def columnwise_operand(self) -> QuantizedTensor:
        """The column-wise layout alone, as a row-wise ``[K, R]`` operand.

        What backward keeps of a forward operand: the transposed matrix, without the
        row-wise bytes (leading dims of the logical shape are flattened into R).
        """
        if self.data_t is None:
            raise ValueError(
                f"{type(self).__name__} of shape {tuple(self.shape)} has no column-wise data; "
                "quantize it with columnwise=True"
            )
        clone = self._with_extras()
        clone.data, clone.scale_inv, clone.block = self.data_t, self.scale_inv_t, self.block_t
        clone.data_t = clone.scale_inv_t = None
        clone.block_t = (0, 0)
        clone.fmt, clone.dtype = self.fmt, self.dtype
        k = self.shape[-1]
        clone.shape = torch.Size((k, self.shape.numel() // k if k else 0))
        return clone

    def _clone_meta(self) -> QuantizedTensor:
        """A shallow copy (the same inner tensors)."""
        clone = self._with_extras()
        clone.data, clone.scale_inv, clone.block = self.data, self.scale_inv, self.block
        clone.data_t, clone.scale_inv_t = self.data_t, self.scale_inv_t
        clone.block_t, clone.fmt, clone.shape = self.block_t, self.fmt, self.shape
        clone.dtype = self.dtype
        return clone

    def _with_extras(self) -> QuantizedTensor:
        """A new object of this class holding only the subclass's own slots (the base
        slots, written out above, are cheaper to copy by name than in a loop: per call)."""
        clone = object.__new__(type(self))
        for name in type(self)._extra_slot_names:
            setattr(clone, name, getattr(self, name))
        return clone

    _slot_names: ClassVar[tuple[str, ...]] = ()
    _extra_slot_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Every slot of the class and its bases, for unflattening; and those beyond
        # QuantizedTensor's, for copying.
        cls._slot_names = tuple(
            name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())
        )
        cls._extra_slot_names = tuple(
            name for name in cls._slot_names if name not in QuantizedTensor.__slots__
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by data and scales of every layout present (shared ones once)."""
        unique = {id(t): t for t in (getattr(self, n) for n in self.inner_names) if t is not None}
        return sum(t.numel() * t.element_size() for t in unique.values())

    # -- flatten / unflatten (torch.compile and checkpoint codecs) ------------------------
    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        names = [n for n in self.inner_names if getattr(self, n) is not None]
        ctx = {
            "storage": self.storage_name,
            "fmt": self.fmt,
            "shape": tuple(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "block": self.block,
            "block_t": self.block_t,
        }
        return names, ctx

    @classmethod
    def __tensor_unflatten__(
        cls,
        inner_tensors: dict[str, torch.Tensor],
        ctx: dict[str, Any],
        outer_size: Any = None,
        outer_stride: Any = None,
    ) -> QuantizedTensor:
        klass = STORAGE[ctx["storage"]]
        dtype = getattr(torch, ctx["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {ctx['dtype']!r}")
        obj = object.__new__(klass)
        for name in klass._slot_names:
            setattr(obj, name, None)
        for name in klass.inner_names:
            setattr(obj, name, inner_tensors.get(name))
        obj.fmt = ctx["fmt"]
        obj.shape = torch.Size(ctx["shape"])
        obj.dtype = dtype
        obj.block = tuple(ctx["block"])
        obj.block_t = tuple(ctx["block_t"])
        return obj

    def __repr__(self) -> str:
        layouts = [
            name
            for name, data in (("rowwise", self.data), ("columnwise", self.data_t))
            if data is not None
        ]
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, fmt={self.fmt}, "
            f"dtype={self.dtype}, block={self.block}, layouts={'+'.join(layouts)})"
        )


def block_family(block: tuple[int, int]) -> str:
    """The GEMM family of an FP8 layout with FP32 scales over ``block``."""
    if block == WHOLE:
        return TENSORWISE
    if block == (1, 0):
        return ROWWISE
    return BLOCKWISE


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
        if op is not None and global_scale_inv.dtype == torch.float32:  # one fused pass
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
            from .reference.hadamard import transform_rows  # (quantize imports this module)

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


