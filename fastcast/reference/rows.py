"""Row-wise FP8: one scale per row (or column) of a matrix, from its amax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..formats import ELEMENT_MAX
from .cast import scale_and_cast, scale_from_amax


def row_amax(m: torch.Tensor, dim: int) -> torch.Tensor:
    """max |m| along ``dim`` of the matrix ``m``, FP32, keeping the dim (NaN if a NaN is
    there; 0 for an empty row)."""
    if m.shape[dim] == 0:  # the max of nothing is an error in torch
        shape = [1, 1]
        shape[1 - dim] = m.shape[1 - dim]
        return torch.zeros(shape, dtype=torch.float32, device=m.device)
    # max(max, -min): two reductions that propagate NaN, and no |m| temporary (on the
    # CPU, torch 2.13, a fresh [R, K] buffer costs more than the passes; vector_norm
    # with ord=inf along a dim is 20x slower still).
    top = m.amax(dim=dim, keepdim=True).float()
    return torch.maximum(top, m.amin(dim=dim, keepdim=True).float().neg_())


def quantize_rows_reference(
    m: torch.Tensor,
    fmt: str,
    power_2: bool,
    columns: bool,
    reduce_amax: Callable[[torch.Tensor], Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrix ``m`` ``[R, K]`` quantized with one scale per row (``scale_inv``
    ``[R, 1]``) or, with ``columns``, per column (``[1, K]``), codes in ``m``'s layout:
    ``quantize_rows`` in PyTorch operations (the definition the fused operators match)."""
    amax = row_amax(m, 0 if columns else 1)
    if reduce_amax is not None:  # the rows are split across ranks: the whole row's amax
        reduce_amax(amax)
    scale = scale_from_amax(amax, ELEMENT_MAX[fmt], power_2=power_2)
    return scale_and_cast(m, scale, fmt), scale.reciprocal()
