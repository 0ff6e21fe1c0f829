"""The quantizer capability over groups of rows, ``quantize_groups``.

A quantizer quantizes each group (``TokenGroups``) as if it were a tensor of its own.
Scales that span rows (per-tensor, NVFP4's tensor scale) are then per group, and a
column-wise layout (along the rows: what a GEMM contracting over the tokens reads) has its
blocks inside one group, the caller having moved each group to a start that is a multiple
of the quantizer's ``token_block`` (``pad_groups``). The built-in quantizers work by
device-side index arithmetic; any other quantizer is called once per group (here), which
reads the sizes on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from ..tensor import QuantizedTensor
from ..token_groups import TokenGroups, group_amax, group_ids, pad_groups, padded_rows

# The value type and its arithmetic live in ``fastcast.token_groups``; importable here too.
__all__ = [
    "TokenGroups",
    "dequantize_groups",
    "group_amax",
    "group_ids",
    "pad_groups",
    "padded_rows",
    "quantize_groups",
]


def quantize_groups(
    quantizer: Any, m: torch.Tensor, groups: TokenGroups, columnwise: bool = False
) -> QuantizedTensor | list[QuantizedTensor]:
    """``m`` ``[R, D]`` quantized group by group: along D (the row-wise layout), or with
    ``columnwise`` along the rows within each group. The quantizer's own
    ``quantize_groups`` where it has one (None from it: not for these groups), else one
    ``quantize`` per group, in order (the sizes read on the host unless ``groups.size``
    gives them), each group's result one item of the list."""
    native = getattr(quantizer, "quantize_groups", None)
    if native is not None:
        result = native(m, groups, columnwise=columnwise)
        if result is not None:
            return result
    if groups.size is not None:
        sizes = [groups.size] * groups.count
    else:  # (the default for quantizers without the capability: a read back)
        sizes = torch.bincount(groups.ids, minlength=groups.count).tolist()
    parts, start = [], 0
    for size in sizes:
        part = m[start : start + size]
        start += size
        if size:
            parts.append(quantizer.quantize(part, rowwise=not columnwise, columnwise=columnwise))
    return parts


def dequantize_groups(q: QuantizedTensor | list[QuantizedTensor]) -> torch.Tensor:
    """FP32 ``[R, D]`` of ``quantize_groups``' result: what a GEMM emulation reads (a
    column-wise layout as it is: transformed, if it holds a Hadamard transform)."""
    if isinstance(q, QuantizedTensor):
        return _values(q)
    return torch.cat([_values(part) for part in q])


def _values(q: QuantizedTensor) -> torch.Tensor:
    if q.data is not None:
        return q.dequantize_rowwise_2d()
    return q.columnwise_operand().dequantize_rowwise_2d().t()
