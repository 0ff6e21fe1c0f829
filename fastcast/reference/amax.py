"""Delayed scaling's amax recording: the running max of finite amaxes."""

from __future__ import annotations

import torch

from .cast import scale_from_amax, tensor_amax


def record_amax_reference(slot: torch.Tensor, x: torch.Tensor) -> None:
    """``record_amax`` in PyTorch operations (the definition the fused operators match)."""
    # NaN and inf become 0, which never raises the slot (an amax is >= 0): no host sync.
    amax = tensor_amax(x).nan_to_num_(nan=0.0, posinf=0.0)
    torch.maximum(slot, amax.reshape(slot.shape), out=slot)


def delayed_update_reference(
    history: torch.Tensor, scale: torch.Tensor, fmt_max: float, margin: int, most_recent: bool
) -> None:
    """One slab's delayed-scaling update in place (what the fused ``delayed_update``
    operator matches bit for bit): each column that recorded an amax this step (row 0
    > 0) takes the scale of its window's amax (the max over its rows, or row 0 alone
    when ``most_recent``; a non-finite or zero amax keeps the old scale) and has its
    history rolled up by one row; every row 0 is then zeroed."""
    amax = history[0].clone() if most_recent else history.amax(dim=0)
    new = scale_from_amax(amax, fmt_max, margin=margin, fallback=scale)
    ran = history[0] > 0
    scale.copy_(torch.where(ran, new, scale))
    if history.shape[0] > 1:
        history.copy_(torch.where(ran, torch.roll(history, -1, dims=0), history))
    history[0].zero_()
