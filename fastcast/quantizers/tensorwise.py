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
from typing import Any

import torch

from ..formats import ELEMENT_MAX, FP8_DTYPES
from ..kernels import fused_op, tensorwise_op
from ..profiling import annotate
from ..reference.amax import record_amax_reference
from ..reference.cast import as_matrix, scale_and_cast, scale_from_amax, tensor_amax
from ..reference.rows import row_amax
from ..tensor import WHOLE, Float8Tensor
from .base import PER_ROW, check_fp8_format, check_input, transposed_codes
from .groups import TokenGroups


def quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool
) -> Float8Tensor:
    """Quantize ``x`` with the per-tensor ``scale`` (FP32 scalar tensor)."""
    op = _scalar_op("quantize_tensorwise", x, scale)
    if op is not None:
        data, scale_inv, _ = op(x, scale, FP8_DTYPES[fmt], False, 0.0, True, False)
    else:
        data = scale_and_cast(x, scale, fmt)
        # A fresh tensor, so a later in-place scale update cannot change what this holds.
        scale_inv = scale.reciprocal()
    return _float8(x, fmt, data, scale_inv, rowwise, columnwise)


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
) -> Float8Tensor:
    """The quantized tensor holding ``data`` (FP8, shaped like ``x``) in the layouts asked."""
    # Per-tensor FP8 transposes exactly: the column-wise layout is the transposed data.
    data_t = transposed_codes(as_matrix(data)) if columnwise else None
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
    margin: int = 0

    def __post_init__(self) -> None:
        check_fp8_format(type(self).__name__, self.fmt)

    @annotate("fastcast.quantize.tensorwise")
    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        check_input(x)
        if self.amax_reduction_group is None and not self.margin:
            op = tensorwise_op(x)
            if op is not None:  # amax, scale and cast in one operator
                # (The CPU kernel writes the row-wise data only: the column-wise layout
                # is its transposed view, as in the reference.)
                fmt, power_2, epsilon = self.fmt, self.power_2_scales, self.amax_epsilon
                data, scale_inv, _ = op(x, None, FP8_DTYPES[fmt], power_2, epsilon, True, False)
                return _float8(x, fmt, data, scale_inv, rowwise, columnwise)
        amax = tensor_amax(x)
        if self.amax_reduction_group is not None:
            from ..distributed import all_reduce_max  # noqa: PLC0415 - only with a group

            all_reduce_max(amax, self.amax_reduction_group)
        scale = self._scale(amax)
        return quantize_with_scale(x, scale, self.fmt, rowwise, columnwise)

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        return scale_from_amax(
            amax,
            ELEMENT_MAX[self.fmt],
            margin=self.margin,
            power_2=self.power_2_scales,
            epsilon=self.amax_epsilon,
        )

    def quantize_groups(
        self, m: torch.Tensor, groups: TokenGroups, *, columnwise: bool = False
    ) -> Float8Tensor:
        """``m`` ``[R, D]`` with one scale per group of rows (``quantizers.groups``), held
        per row; casting with one scale is elementwise, so the row-wise layout is the
        column-wise one too, and it is what is returned either way."""
        rows = self._scale(groups.amax(row_amax(m, 1).squeeze(1)))[groups.ids].unsqueeze(1)
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

    __slots__ = ("meta", "index", "fmt", "recording")

    def __init__(self, meta: Any, index: int, fmt: str = "e4m3") -> None:
        check_fp8_format(type(self).__name__, fmt)
        self.meta = meta
        self.index = index
        self.fmt = fmt
        self.recording = True

    @property
    def scale(self) -> torch.Tensor:
        return self.meta.scale_views[self.index]

    @annotate("fastcast.quantize.tensorwise")
    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        check_input(x)
        # Through the property, once: compiled code overrides it (dynamo/delayed.py).
        scale = self.scale
        if self.recording:
            slot = self.meta.amax_slots[self.index]
            # The views are one-element FP32 tensors, the slot on the scale's device: only
            # the scale's side of the CPU/GPU divide needs a look per call.
            op = fused_op("quantize_recording", x) if scale.is_cpu == x.is_cpu else None
            if op is not None:  # one pass over x
                data, scale_inv = op(x, scale, slot, FP8_DTYPES[self.fmt])
                return _float8(x, self.fmt, data, scale_inv, rowwise, columnwise)
            record_amax(slot, x)
        return quantize_with_scale(x, scale, self.fmt, rowwise, columnwise)


class FixedScaleQuantizer:
    """Quantize with a given scale tensor and record nothing (activation recomputation
    replays the scales of the original forward this way)."""

    __slots__ = ("scale", "fmt")

    def __init__(self, scale: torch.Tensor, fmt: str) -> None:
        self.scale = scale
        self.fmt = fmt

    @annotate("fastcast.quantize.tensorwise")
    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        check_input(x)
        return quantize_with_scale(x, self.scale, self.fmt, rowwise, columnwise)


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
