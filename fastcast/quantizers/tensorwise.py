"""Per-tensor FP8 scaling: current (from this tensor) and delayed (from past amaxes).

Non-finite values: an inf or NaN element stays non-finite in the data (``scale_and_cast``):
+-inf is +-inf in E5M2 and NaN in E4M3 (``float8_e4m3fn`` has no infinity), NaN is NaN,
so each dequantizes to a non-finite value and overflow checks downstream
(``torch.amp.GradScaler``) still see it. Only finite values beyond the range saturate to
+-max, those whose product with the scale overflows FP32 included (a stale delayed scale).
The scale: current scaling falls back to 1.0 when the amax is non-finite (the other
elements of that tensor are then scaled by 1.0); delayed scaling uses the scale from
earlier steps, so the other elements are quantized exactly as without the inf, and
``record_amax`` leaves a non-finite amax out of the history.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..formats import ELEMENT_MAX, FP8_DTYPES
from ..kernels import fused_op, tensorwise_op
from ..reference.amax import record_amax_reference
from ..reference.cast import as_matrix, scale_and_cast, scale_from_amax, tensor_amax
from ..reference.rows import row_amax
from ..runtime.observers import attached as _observers
from ..runtime.observers import begin as _begin
from ..runtime.observers import end as _end
from ..tensor import WHOLE, Float8Tensor
from ..token_groups import TokenGroups
from .base import (
    PER_ROW,
    PER_TENSOR_BLOCKS,
    Blocks,
    check_fp8_format,
    check_input,
    transposed_codes,
)
from .reduction import GroupMax, all_reduce_max


def quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool
) -> Float8Tensor:
    """Quantize ``x`` with the per-tensor ``scale`` (FP32 scalar tensor)."""
    op = _scalar_op("quantize_tensorwise", x, scale)
    if op is not None:
        rows, cols = _fused_layouts(x, rowwise, columnwise)
        data, scale_inv, data_t = op(x, scale, FP8_DTYPES[fmt], False, 0.0, rows, cols)
        return _float8(x, fmt, data, scale_inv, rowwise, columnwise, data_t if cols else None)
    data = scale_and_cast(x, scale, fmt)
    # A fresh tensor, so a later in-place scale update cannot change what this holds.
    scale_inv = scale.reciprocal()
    return _float8(x, fmt, data, scale_inv, rowwise, columnwise)


def _fused_layouts(x: torch.Tensor, rowwise: bool, columnwise: bool) -> tuple[bool, bool]:
    """The layouts the fused operator writes. On CUDA those asked, in one pass: its tiled
    kernel writes the transposed codes, where a transposing copy of one-byte codes
    afterwards would cost more than the cast (the H200 runs). On the CPU the row-wise
    codes, whose transposed view serves as the column-wise layout."""
    return (rowwise, columnwise) if x.is_cuda else (True, False)


def _scalar_op(name: str, x: torch.Tensor, *scalars: torch.Tensor) -> Any:
    """The fused operator ``name`` for ``x`` when it can take ``scalars`` (scales, amax
    slots) too: each a one-element FP32 tensor on x's side of the CPU/GPU divide. None
    otherwise: the reference runs."""
    op = fused_op(name, x)
    if op is None:
        return None
    for t in scalars:
        if t.is_cpu != x.is_cpu or t.numel() != 1 or t.dtype != torch.float32:
            return None
    return op


def _float8(
    x: torch.Tensor,
    fmt: str,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    data_t: torch.Tensor | None = None,
) -> Float8Tensor:
    """The quantized tensor holding ``data`` (FP8, shaped like ``x``) in the layouts asked;
    ``data_t``, the column-wise codes where the operator wrote them."""
    # Per-tensor FP8 transposes exactly: the column-wise layout is the transposed data.
    if columnwise and data_t is None:
        data_t = transposed_codes(as_matrix(data))
    return Float8Tensor.assemble(
        fmt,
        x.shape,
        x.dtype,
        data if rowwise else None,
        scale_inv if rowwise else None,
        WHOLE,
        data_t,
        scale_inv if columnwise else None,
        WHOLE,
    )


@dataclasses.dataclass(frozen=True)
class CurrentScalingQuantizer:
    """Scale from this tensor's amax. A value object: equal fields, equal quantizers.

    With ``amax_reduction_group`` the amax is the max over the group's ranks (tensor- or
    sequence-parallel layers whose shards must share one scale). ``margin``: the scale is
    ``fmt_max / amax / 2**margin`` (delayed scaling's margin, for the grouped GEMMs that
    run it as current scaling per token group).
    """

    fmt: str = "e4m3"
    power_2_scales: bool = False
    amax_epsilon: float = 0.0
    amax_reduction_group: Any = None
    # Any other amax reducer (``over_shards``): the FSDP2 gather's, which keeps reductions.
    reduce_amax: Callable[[torch.Tensor], Any] | None = None
    margin: int = 0

    scale_blocks: ClassVar[Blocks] = PER_TENSOR_BLOCKS
    pure: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_fp8_format(type(self).__name__, self.fmt)

    def over_shards(self, reduce: Any, dim: int) -> CurrentScalingQuantizer:
        """One scale spans every shard: its amax is reduced (already, with a group: the
        autocast's, which contains the shards')."""
        if self.amax_reduction_group is not None or self.reduce_amax is not None:
            return self
        if isinstance(reduce, GroupMax):
            return dataclasses.replace(self, amax_reduction_group=reduce.group)
        return dataclasses.replace(self, reduce_amax=reduce)

    def shard_amax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor_amax(x)

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        return scale_from_amax(
            amax,
            ELEMENT_MAX[self.fmt],
            margin=self.margin,
            power_2=self.power_2_scales,
            epsilon=self.amax_epsilon,
        )

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        opened = _begin("fastcast.quantize.tensorwise") if _observers else None  # observer point
        try:
            check_input(x)
            if self.amax_reduction_group is None and self.reduce_amax is None and not self.margin:
                op = tensorwise_op(x)
                if op is not None:  # amax, scale and cast in one operator
                    fmt, power_2, epsilon = self.fmt, self.power_2_scales, self.amax_epsilon
                    rows, cols = _fused_layouts(x, rowwise, columnwise)
                    data, scale_inv, data_t = op(
                        x, None, FP8_DTYPES[fmt], power_2, epsilon, rows, cols
                    )
                    return _float8(
                        x, fmt, data, scale_inv, rowwise, columnwise, data_t if cols else None
                    )
            amax = tensor_amax(x)
            if self.amax_reduction_group is not None:
                all_reduce_max(amax, self.amax_reduction_group)
            elif self.reduce_amax is not None:
                self.reduce_amax(amax)
            return quantize_with_scale(x, self.scale_for(amax), self.fmt, rowwise, columnwise)
        finally:
            if opened is not None:
                _end(opened)

    def quantize_groups(
        self, m: torch.Tensor, groups: TokenGroups, *, columnwise: bool = False
    ) -> Float8Tensor:
        """``m`` ``[R, D]`` with one scale per group of rows (``quantizers.groups``), held
        per row; casting with one scale is elementwise, so the row-wise layout is the
        column-wise one too, and it is what is returned either way."""
        rows = self.scale_for(groups.amax(row_amax(m, 1).squeeze(1)))[groups.ids].unsqueeze(1)
        data = scale_and_cast(m, rows, self.fmt)
        return Float8Tensor.assemble(
            self.fmt, m.shape, m.dtype, data, rows.reciprocal(), PER_ROW, None, None, WHOLE
        )


class DelayedScalingQuantizer:
    """Scale from the amax history of earlier steps; records this tensor's amax.

    ``meta`` is a ``delayed.ScalingMeta`` (or any object with ``scale_views`` and
    ``amax_slots`` lists of one-element FP32 tensors, all on one device); ``index`` is
    this role's column. The quantizer reads the scale the last update produced and
    max-accumulates this call's amax into the slot, so a module called twice in a step
    keeps the larger amax. The views are looked up per call because the registry
    re-points them when it grows. It holds live state, so it keeps identity semantics.
    """

    __slots__ = ("meta", "index", "fmt", "recording", "read")

    scale_blocks: ClassVar[Blocks] = PER_TENSOR_BLOCKS
    from_history: ClassVar[bool] = True

    def __init__(
        self,
        meta: Any,
        index: int,
        fmt: str = "e4m3",
        read: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        check_fp8_format(type(self).__name__, fmt)
        self.meta = meta
        self.index = index
        self.fmt = fmt
        self.recording = True
        # How the scale view is read: compiled code reads a snapshot (fastcast.compile).
        self.read = read

    @property
    def scale(self) -> torch.Tensor:
        view = self.meta.scale_views[self.index]
        return view if self.read is None else self.read(view)

    def over_shards(self, reduce: Any, dim: int) -> DelayedScalingQuantizer:
        # Each shard records its own amax; the step's update reduces the history over
        # the autocast's group, which must then contain the shards' ranks.
        return self

    def casts_like(self, other: object) -> bool:
        """Any eager quantizer over the same scale slot (plans are rebuilt)."""
        return (
            type(other) is DelayedScalingQuantizer
            and other.read is None
            and other.meta is self.meta
            and other.index == self.index
        )

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        opened = _begin("fastcast.quantize.tensorwise") if _observers else None  # observer point
        try:
            check_input(x)
            # Through the property, once: compiled code overrides it (dynamo/delayed.py).
            scale = self.scale
            if self.recording:
                slot = self.meta.amax_slots[self.index]
                # The views are one-element FP32 tensors, the slot on the scale's device: only
                # the scale's side of the CPU/GPU divide needs a look per call.
                op = fused_op("quantize_recording", x) if scale.is_cpu == x.is_cpu else None
                # The recording cast writes row-wise codes only. Where a CUDA caller wants
                # the column-wise layout too, the amax pass and the tiled cast of both
                # layouts below cost less than transposing the codes afterwards.
                if op is not None and not (columnwise and x.is_cuda):  # one pass over x
                    data, scale_inv = op(x, scale, slot, FP8_DTYPES[self.fmt])
                    return _float8(x, self.fmt, data, scale_inv, rowwise, columnwise)
                record_amax(slot, x)
            return quantize_with_scale(x, scale, self.fmt, rowwise, columnwise)
        finally:
            if opened is not None:
                _end(opened)


class FixedScaleQuantizer:
    """Quantize with a given scale tensor and record nothing (activation recomputation
    replays the scales of the original forward this way)."""

    __slots__ = ("scale", "fmt")

    scale_blocks: ClassVar[Blocks] = PER_TENSOR_BLOCKS

    def __init__(self, scale: torch.Tensor, fmt: str) -> None:
        self.scale = scale
        self.fmt = fmt

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        opened = _begin("fastcast.quantize.tensorwise") if _observers else None  # observer point
        try:
            check_input(x)
            return quantize_with_scale(x, self.scale, self.fmt, rowwise, columnwise)
        finally:
            if opened is not None:
                _end(opened)


def record_amax(slot: torch.Tensor, x: torch.Tensor) -> None:
    """``slot = max(slot, amax(x))`` in place, for a finite amax only.

    A non-finite amax (``x`` holds an inf or a NaN) records nothing. Recorded, it would
    make the max over the history window non-finite for ``amax_history_len`` updates, and
    each of them would keep the previous scale: one overflow would freeze the scale for
    the whole window. Nothing is lost by leaving it out: the quantized tensor keeps the
    non-finite values, so they reach the output or the gradients, where an overflow check
    (``torch.amp.GradScaler``) sees them and skips that step anyway.
    """
    op = _scalar_op("record_amax", x, slot)
    if op is not None:  # one pass, one dispatch
        op(slot, x)
        return
    record_amax_reference(slot, x)
