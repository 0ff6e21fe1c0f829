"""Row-wise FP8: one FP32 scale per row of the ``[R, K]`` matrix, from that row's amax.

Each layout is scaled along the dim a GEMM contracts over its rows: the row-wise layout
per row of ``x`` (along K), the column-wise layout per row of ``x.T`` (along R), from
``x.T``'s own amaxes (a per-column amax of ``x``), not from the row-wise scales.

Non-finite values stay non-finite (``scale_and_cast``): NaN is NaN, +-inf is +-inf in E5M2
and NaN in E4M3. A row holding one gets scale 1 (its other elements are scaled by 1), as
does a row of zeros; every other row is quantized as if that row were not there. Only
finite values beyond the range saturate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..formats import ELEMENT_MAX, FP8_DTYPES
from ..kernels import fused_op
from ..reference.cast import as_matrix, scale_and_cast, scale_from_amax, tensor_amax
from ..reference.rows import quantize_rows_reference, row_amax
from ..runtime.observers import attached as _observers
from ..runtime.observers import begin as _begin
from ..runtime.observers import end as _end
from ..tensor import WHOLE, Float8Tensor
from ..token_groups import TokenGroups
from .base import PER_ROW, Blocks, check_fp8_format, check_input, transposed_codes
from .sharded import ShardedRowwiseQuantizer

PER_ELEMENT = (1, 1)  # a scale per element: per (group, feature) in quantize_groups


def quantize_rows(
    m: torch.Tensor, fmt: str, power_2: bool, columns: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrix ``m`` ``[R, K]`` quantized with one scale per row (``scale_inv``
    ``[R, 1]``) or, with ``columns``, per column (``[1, K]``), codes in ``m``'s layout: the
    fused operator where there is one (on the CPU each row's amax and cast while it is in
    cache), else the reference; the same values."""
    op = fused_op("quantize_rows", m)
    if op is not None:
        return op(m, FP8_DTYPES[fmt], power_2, columns)
    return quantize_rows_reference(m, fmt, power_2, columns)


@dataclasses.dataclass(frozen=True)
class RowwiseQuantizer:
    """FP8 with one FP32 scale per row of each layout. A value object.

    The tensor is viewed as ``[R, K]`` (leading dims flattened). Row-wise layout: ``data``
    shaped like the input, ``scale_inv`` ``[R, 1]``, row r scaled by
    ``fmt_max / amax(x[r, :])``. Column-wise layout: ``data_t`` ``[K, R]``,
    ``scale_inv_t`` ``[K, 1]``, row k of ``x.T`` scaled by ``fmt_max / amax(x[:, k])``.
    A scale is rounded down to a power of two with ``power_2_scales``; amax 0, NaN or
    inf gives scale 1 (``scale_from_amax``).

    ``columnwise_per_tensor``: the column-wise layout takes one scale for the whole tensor
    (``fmt_max / amax(x)``), stored per row (``[K, 1]``, all equal) so that its GEMMs stay
    row-wise ones: how ``rowwise_with_gw_hp`` scales the weight for dgrad.
    """

    fmt: str = "e4m3"
    power_2_scales: bool = True
    columnwise_per_tensor: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_fp8_format(name, self.fmt)
        for field in ("power_2_scales", "columnwise_per_tensor"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise ValueError(f"{name}: {field} must be a bool, got {value!r}")

    scale_blocks: ClassVar[Blocks] = (PER_ROW, PER_ROW)
    pure: ClassVar[bool] = True

    def over_shards(self, reduce: Any, dim: int) -> Any:
        """Split along K: the row-wise layout's rows span the shards; along the rows: the
        column-wise layout's; either way ``columnwise_per_tensor``'s one amax."""
        return ShardedRowwiseQuantizer(
            self, reduce, dim == 1, dim == 0 or self.columnwise_per_tensor
        )

    def shard_amax(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        m = as_matrix(x)
        if self.columnwise_per_tensor:
            # Along the rows its one amax; along K that and the rows': not one tensor.
            return tensor_amax(m) if dim == 0 else None
        return row_amax(m, dim)  # what the layout whose rows span ``dim`` reduces

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        return scale_from_amax(amax, ELEMENT_MAX[self.fmt], power_2=self.power_2_scales)

    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = False,
        reduce_rows: Callable[[torch.Tensor], Any] | None = None,
        reduce_columns: Callable[[torch.Tensor], Any] | None = None,
    ) -> Float8Tensor:
        """``reduce_rows`` / ``reduce_columns`` max-reduce the amaxes of the row-wise /
        column-wise layout in place before its scales are made (rows split across ranks
        get the whole row's scale); a layout reduced runs the reference."""
        opened = _begin("fastcast.quantize.rowwise") if _observers else None  # observer point
        try:
            check_input(x)
            if not (rowwise or columnwise):
                raise ValueError(f"{type(self).__name__}: ask for rowwise and/or columnwise data")
            m = as_matrix(x)
            data = scale_inv = data_t = scale_inv_t = None
            if rowwise:
                data, scale_inv = self._slices(m, False, reduce_rows)
                data = data.reshape(x.shape)
            if columnwise:
                # Cast in m's layout (rows of x.T are m's columns: elementwise, the same
                # codes), then transpose the FP8 bytes rather than copy m transposed.
                if self.columnwise_per_tensor:
                    amax = tensor_amax(m)
                    if reduce_columns is not None:
                        reduce_columns(amax)
                    scale_t = self._scale(amax).expand(1, m.shape[1])
                    codes, scale_inv_t = scale_and_cast(m, scale_t, self.fmt), scale_t.reciprocal()
                else:
                    codes, scale_inv_t = self._slices(m, True, reduce_columns)
                data_t = transposed_codes(codes)
                scale_inv_t = scale_inv_t.reshape(-1, 1).contiguous()
            return Float8Tensor(
                fmt=self.fmt,
                shape=x.shape,
                dtype=x.dtype,
                data=data,
                scale_inv=scale_inv,
                block=PER_ROW,
                data_t=data_t,
                scale_inv_t=scale_inv_t,
                block_t=PER_ROW,
            )
        finally:
            if opened is not None:
                _end(opened)

    def _slices(
        self, m: torch.Tensor, columns: bool, reduce: Callable[[torch.Tensor], Any] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes in ``m``'s layout and scale_inv, one scale per row (per column with
        ``columns``); with ``reduce``, the amaxes are reduced before the scales."""
        if reduce is None:
            return quantize_rows(m, self.fmt, self.power_2_scales, columns=columns)
        return quantize_rows_reference(m, self.fmt, self.power_2_scales, columns, reduce)

    def quantize_groups(
        self, m: torch.Tensor, groups: TokenGroups, *, columnwise: bool = False
    ) -> Float8Tensor:
        """``m`` ``[R, D]`` per group of rows (``quantizers.groups``): the row-wise layout
        is ``quantize``'s (its rows are scaled alone); the column-wise one has a scale per
        (group, feature), or per group with ``columnwise_per_tensor``, held per element
        (per row) of a layout shaped like ``m``."""
        if not columnwise:
            return self.quantize(m)
        if self.columnwise_per_tensor:
            amax = groups.amax(row_amax(m, 1).squeeze(1)).unsqueeze(1)
        else:
            amax = torch.zeros(groups.count, m.shape[1], dtype=torch.float32, device=m.device)
            index = groups.ids.unsqueeze(1).expand(m.shape)
            amax.scatter_reduce_(0, index, m.float().abs(), "amax", include_self=True)
        scale = self._scale(amax)[groups.ids]
        block = PER_ROW if self.columnwise_per_tensor else PER_ELEMENT
        data = scale_and_cast(m, scale, self.fmt)
        return Float8Tensor.assemble(
            self.fmt, m.shape, m.dtype, data, scale.reciprocal(), block, None, None, WHOLE
        )
