"""The quantized weight a module keeps across the micro-batches of one step."""

from __future__ import annotations

from typing import Any

import torch

from ..quantizers.base import Quantizer
from ..runtime.state import optimizer_steps
from ..tensor import QuantizedTensor


class WeightCache:
    """``is_first_microbatch=True`` quantizes the weight and keeps it; ``False`` reuses
    it while it is still what quantizing the weight would give: same weight version and
    storage (``weight.data = other`` replaces the storage), no optimizer step since (fused
    optimizers leave the version counter alone), the same quantizer, and the layouts
    asked for. Writes through ``weight.data`` in place (``weight.data.copy_(...)``) move
    no version counter and cannot be seen cheaply: pass ``is_first_microbatch=True`` after
    them. ``fc.Linear`` also clears it when another weight object is set on it (FSDP2's
    gathers write the unsharded weight without moving its version counter, but swap it
    in and out with setattr)."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: tuple[QuantizedTensor, tuple[int, int, int], Quantizer] | None = None

    def clear(self) -> None:
        self.entry = None


def quantize_weight(
    cache: WeightCache,
    weight: torch.Tensor,
    quantizer: Any,
    first: bool | None,
    columnwise: bool,
) -> QuantizedTensor:
    """The quantized ``weight``, from ``cache`` when ``first`` is False and it is valid.

    (A function, not a method, so that ``fastcast.compile`` can give compiled code its own.)
    """
    entry = cache.entry
    if first is False and entry is not None:
        w_q, version, cached_by = entry
        if (
            version == (weight._version, weight.data_ptr(), optimizer_steps())
            and cached_by is quantizer
            and (w_q.has_columnwise or not columnwise)
        ):
            return w_q
    w_q = quantizer.quantize(weight, rowwise=True, columnwise=columnwise)
    if first is None:
        cache.entry = None
    else:
        version = (weight._version, weight.data_ptr(), optimizer_steps(install=True))
        cache.entry = (w_q, version, quantizer)
    return w_q
