"""The emulation's operands: what the hardware would read, in FP32.

Each operand is quantized by the recipe's quantizers group by group
(``quantizers.groups.quantize_groups``: the tokens per expert, the weights per expert)
and dequantized, and laid out as the emulated GEMMs take it (``torch._grouped_mm``'s CPU
sums depend on which dim of the expert operand is contiguous).
"""

from __future__ import annotations

from typing import Any

import torch

from ..quantizers.base import scale_blocks
from ..quantizers.groups import dequantize_groups, quantize_groups
from ..tensor import QuantizedTensor
from ..token_groups import TokenGroups


def token_values(
    quantizer: Any, m: torch.Tensor, groups: TokenGroups, columnwise: bool = False
) -> torch.Tensor:
    """The tokens ``m`` ``[R, D]`` quantized along D (forward and dgrad operands) or, with
    ``columnwise``, along the tokens within each group (the weight-gradient operands,
    whose groups ``pad_groups`` moved to block starts); FP32 ``[R, D]``. A D that is
    not a multiple of the row-wise block (a 16-wide dgrad under MXFP8) is padded with
    zeros: the partial block is scaled from its own elements, and the pad is cut off."""
    cols = m.shape[1]
    blocks = scale_blocks(quantizer)
    width = blocks[0][1] if blocks is not None else 0  # (MXFP8 wants it in both layouts)
    pad = -cols % width if width > 1 else 0
    if pad:
        m = torch.nn.functional.pad(m, (0, pad))
    values = dequantize_groups(quantize_groups(quantizer, m, groups, columnwise))
    return values[:, :cols] if pad else values


def weight_values(quantizer: Any, w: torch.Tensor, along_n: bool = False) -> torch.Tensor:
    """The experts' weights ``[E, N, K]`` quantized per expert along K (the forward
    operand) or, with ``along_n``, along N (its column-wise layout: the dgrad operand);
    FP32 ``[E, N, K]``, contiguous along K, or along N for the dgrad operand (as the
    quantization along N lays it out) unless square tiles made that layout the row-wise
    one's transpose."""
    experts, n, k = w.shape
    groups = TokenGroups.uniform(experts, n, w.device)
    q = quantize_groups(quantizer, w.reshape(experts * n, k), groups, along_n)
    values = dequantize_groups(q).reshape(experts, n, k)
    if along_n and not _square_tiles(q):
        values = values.transpose(1, 2).contiguous().transpose(1, 2)
    return values


def _square_tiles(q: QuantizedTensor | list[QuantizedTensor]) -> bool:
    part = q if isinstance(q, QuantizedTensor) else q[0]
    rows, cols = part.block_t if part.data_t is not None else part.block
    return rows == cols > 1
