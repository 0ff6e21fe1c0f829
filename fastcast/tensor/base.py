"""``QuantizedTensor``: what every quantized storage holds and does.

Up to two layouts (row-wise ``data``/``scale_inv`` and column-wise
``data_t``/``scale_inv_t``, each with its scale ``block``), the element format and the
logical shape and dtype; dequantization (one fused pass for FP8 codes where there is
one, else the reference), ``t()`` and ``columnwise_operand()`` for the backward GEMMs,
and flatten/unflatten for ``torch.compile``. Subclasses say how their codes and scales
decode (``storages.py``) and register under a stable name (``STORAGE``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ..formats import FP8_DTYPES
from ..kernels import fused_op
from ..reference.decode import apply_scales

STORAGE: dict[str, type[QuantizedTensor]] = {}

_FP8_CODES = frozenset(FP8_DTYPES.values())


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

    def rowwise_operand(self) -> QuantizedTensor:
        """The row-wise layout alone (a shallow copy without the column-wise bytes)."""
        clone = self._clone_meta()
        clone.data_t = clone.scale_inv_t = None
        clone.block_t = (0, 0)
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
