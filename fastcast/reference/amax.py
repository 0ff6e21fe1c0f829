"""Delayed scaling's amax recording: the running max of finite amaxes."""

from __future__ import annotations

import torch

from .cast import tensor_amax


def record_amax_reference(slot: torch.Tensor, x: torch.Tensor) -> None:
    """``record_amax`` in PyTorch operations (the definition the fused operators match)."""
    # NaN and inf become 0, which never raises the slot (an amax is >= 0): no host sync.
    amax = tensor_amax(x).nan_to_num_(nan=0.0, posinf=0.0)
    torch.maximum(slot, amax.reshape(slot.shape), out=slot)
