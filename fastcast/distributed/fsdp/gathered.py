"""``GatheredQuantizedWeight``: the unsharded weight of a block-scaled recipe, built from
FSDP2's gathered buffers (``blocks`` says what they hold)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ...tensor import QuantizedTensor
from .blocks import Wire, col_scale_shape, gather_own, split_scales, transposed_nvfp4
from .tensorwise import VIEWS


def post_all_gather(
    outputs: tuple[torch.Tensor, ...], wire: Wire, param_dtype: torch.dtype, out: Any
) -> Any:
    """``fsdp_post_all_gather`` of a block-scaled recipe: a ``GatheredQuantizedWeight``
    over the gathered buffers (later gathers refill them: ``out`` takes the new state)."""
    if out is not None:
        out.take(outputs, wire)
        return None
    gathered = GatheredQuantizedWeight(outputs[0].device, wire, param_dtype)
    gathered.take(outputs, wire)
    return gathered, tuple(outputs)


def _poison(t: torch.Tensor) -> torch.Tensor:
    """Fill scales with NaN (FP32 NaN, E8M0 0xFF, E4M3 0x7F): what uses them before they
    are written computes NaN, never a plausible wrong value."""
    if t.dtype == torch.float32:
        return t.fill_(float("nan"))
    t.view(torch.uint8).fill_(0xFF if t.dtype == torch.uint8 else 0x7F)
    return t


class GatheredQuantizedWeight(torch.Tensor):
    """The unsharded weight FSDP2 builds from a block-scaled recipe's gathered codes and
    scales (views of its all-gather buffers). ``quantized(columnwise)`` is the quantized
    tensor the GEMMs take; any other use sees ``dequantize()``.

    Split layouts (``Wire.layout`` "row" / "col"): the forward's operand takes its
    column-wise codes as a view of the codes buffer and its column-wise scales from
    ``_col_scales``, a tensor of the weight's own; backward's re-gather writes the
    column-wise codes into that buffer and the scales into that tensor, before the input
    gradient's GEMM reads them. Until then the scales are NaN (``_poison``).
    """

    _parts: tuple[torch.Tensor, ...]
    _wire: Wire
    _row_scales: torch.Tensor | None
    _col_scales: torch.Tensor | None

    @staticmethod
    def __new__(cls, device: torch.device, wire: Wire, dtype: torch.dtype) -> Any:
        return torch.Tensor._make_wrapper_subclass(
            cls, wire.shape, dtype=dtype, device=device, requires_grad=False
        )

    def __init__(self, device: torch.device, wire: Wire, dtype: torch.dtype) -> None:
        self._parts = ()
        self._wire = wire
        self._row_scales = self._col_scales = None

    def __repr__(self) -> str:
        wire = self._wire
        kind = f"{wire.cls.__name__}, {wire.layout}"
        return f"GatheredQuantizedWeight(shape={tuple(self.shape)}, {kind})"

    @property
    def quantizer(self) -> Any:
        return self._wire.quantizer

    def take(self, outputs: tuple[torch.Tensor, ...], wire: Wire) -> None:
        """The state of a gather: its buffers, metadata and (split layouts) scales."""
        self._parts, self._wire = tuple(outputs), wire
        if wire.layout not in ("row", "col"):
            return
        if self._col_scales is None:
            rows, cols = wire.shape[0], wire.shape[1]
            shape = col_scale_shape(wire.quantizer, rows, cols)
            self._col_scales = torch.empty(shape, dtype=wire.dtypes[1], device=self.device)
        # In place, under the version the forward saved (as FSDP2 refills its buffers):
        # the saved column-wise operand is meant to see backward's scales.
        with torch.autograd._unsafe_preserve_version_counter(self._col_scales):
            if wire.layout == "row":
                self._row_scales = split_scales(outputs, wire)
                _poison(self._col_scales)
            elif "scale_inv_t" in wire.replicated:  # row-wise scaling: per column, reduced
                self._col_scales.copy_(wire.replicated["scale_inv_t"])
            else:
                self._col_scales.copy_(split_scales(outputs, wire).t())

    def _row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The row-wise codes and scales."""
        wire, parts = self._wire, self._parts
        if wire.layout == "col":
            # A forward during backward (activation checkpointing's recomputation), after
            # the re-gather of the column-wise layout: the row-wise one, gathered now.
            own_parts, own = gather_own(wire, "row")
            return own_parts[0], split_scales(own_parts, own)
        # (Rows first, whatever shape the gather's buffer view has: FSDP2 views it as the
        # last gather's inputs, [R/2, K] after NVFP4's column-wise layout.)
        data = parts[0].view(wire.shape[0], -1)
        return data, parts[1] if wire.layout in ("one", "both") else self._row_scales

    def _columns(self, data: torch.Tensor | None, scale_inv: torch.Tensor | None) -> tuple:
        """The column-wise codes and scales (``data``/``scale_inv``: the row-wise ones)."""
        wire, parts = self._wire, self._parts
        codes, scales = wire.dtypes
        if wire.layout == "one":  # square tiles: the row-wise layout transposed
            nvfp4 = wire.cls.storage_name == "nvfp4"
            data_t = transposed_nvfp4(data) if nvfp4 else data.t().contiguous()
            return data_t, scale_inv.t().contiguous()
        if wire.layout == "both":
            data_t = parts[2].view(codes).t().contiguous()
            scale_inv_t = wire.replicated.get("scale_inv_t")
            if scale_inv_t is None:
                scale_inv_t = parts[3].view(scales).t().contiguous()
            return data_t, scale_inv_t
        # Split: a view of the codes buffer (backward's re-gather fills it).
        return parts[0].view(codes).view(-1, wire.shape[1]).t(), self._col_scales

    def _assemble(self, rowwise: bool, columnwise: bool) -> QuantizedTensor:
        wire = self._wire
        data = scale_inv = data_t = scale_inv_t = None
        if rowwise or wire.layout == "one":
            data, scale_inv = self._row()
            data, scale_inv = data.view(wire.dtypes[0]), scale_inv.view(wire.dtypes[1])
        if columnwise:
            data_t, scale_inv_t = self._columns(data, scale_inv)
        fields = dict(
            fmt=wire.fmt,
            shape=wire.shape,
            dtype=self.dtype,
            data=data if rowwise else None,
            scale_inv=scale_inv if rowwise else None,
            block=wire.block,
            data_t=data_t,
            scale_inv_t=scale_inv_t,
            block_t=wire.block_t,
        )
        extra = {k: v for k, v in wire.replicated.items() if k != "scale_inv_t"}
        return wire.cls(**fields, **extra)

    def quantized(self, columnwise: bool) -> QuantizedTensor:
        """What ``quantizer`` makes of the whole weight (same codes, same scales)."""
        return self._assemble(True, columnwise)

    def fc_quantized(self, quantizer: Any, columnwise: bool) -> QuantizedTensor | None:
        """The GEMM operand when this weight was cast for ``quantizer`` (None otherwise:
        the caller quantizes it, and so sees the dequantized weight)."""
        if quantizer != self.quantizer:
            return None
        if self._wire.layout in ("row", "col") and torch.compiler.is_compiling():
            # Split layouts in a graph: it saves copies of its operands for backward, and
            # the copy of the column-wise one would hold the NaN scales that backward's
            # re-gather replaces in the buffers (a "col" forward would gather a layout of
            # its own). The graph quantizes the dequantized weight instead (from the
            # layout at hand: MXFP8's E8M0 blocks give the same codes again).
            return None
        return self.quantized(columnwise)

    def dequantize(self) -> torch.Tensor:
        """The weight the codes stand for (from the layout at hand: no collective)."""
        col = self._wire.layout == "col"
        return self._assemble(not col, col).dequantize(self.dtype)

    def _like(self) -> GatheredQuantizedWeight:
        """Another wrapper of the same state (the buffers, the scale tensors)."""
        other = GatheredQuantizedWeight(self.device, self._wire, self.dtype)
        other._parts, other._row_scales = self._parts, self._row_scales
        other._col_scales = self._col_scales
        return other

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        this = args[0] if args else None
        if func in VIEWS and isinstance(this, cls):
            # FSDP2 views the gathered parameter at its own size: the state stays.
            probe = torch.empty(this.shape, device="meta")
            if func(probe, *args[1:], **(kwargs or {})).shape == this.shape:
                return this._like()
        # Anything else computes with the dequantized weight (in high precision).
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        # torch.compile deep-copies this context and compares it at every call (a guard):
        # plain values only. The reduced scales go as inner tensors; the shard and the
        # process group (a gather of its own, ``_row``) stay out of it.
        wire = self._wire
        names = [f"_p{i}" for i in range(len(self._parts))]
        for name, part in zip(names, self._parts):
            setattr(self, name, part)
        names += [n for n in ("_row_scales", "_col_scales") if getattr(self, n) is not None]
        for key, t in wire.replicated.items():
            setattr(self, f"_r_{key}", t)
            names.append(f"_r_{key}")
        plain = dataclasses.replace(wire, replicated={}, source=None, group=None)
        return names, (plain, tuple(wire.replicated), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, size: Any, stride: Any) -> Any:
        plain, replicated, dtype = meta
        wire = dataclasses.replace(plain, replicated={k: inner[f"_r_{k}"] for k in replicated})
        parts = tuple(inner[f"_p{i}"] for i in range(sum(k.startswith("_p") for k in inner)))
        out = GatheredQuantizedWeight(parts[0].device, wire, dtype)
        out._parts = parts
        out._row_scales, out._col_scales = inner.get("_row_scales"), inner.get("_col_scales")
        return out
