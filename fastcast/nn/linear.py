"""``fc.Linear``: ``nn.Linear`` whose GEMMs run in FP8/FP4 inside ``fc.autocast``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import is_dtensor
from ..quantizers.base import check_input
from ..runtime.state import AutocastFrame, get_stack, mark_ran
from ..schemes import ModuleState, Plan
from .function import linear_gemms, plan_for
from .linear_state import LinearState
from .recompute import checkpoint_region, checkpointed_call
from .weight_cache import WeightCache


class Linear(LinearState, nn.Linear):
    """Drop-in for ``nn.Linear``: same constructor, parameters and state-dict keys. Only a
    layer that keeps per-module state (DelayedScaling's amax histories and scales: after
    it ran under that recipe, or once ``fc.convert(..., recipe=fc.DelayedScaling())``
    prepared them) adds ``_extra_state``, one small float32 tensor
    (``fastcast.serialization.extra_state`` has its layout); under any other recipe, or
    none, its state dict is exactly ``nn.Linear``'s (``nn.linear_state`` says what loading
    a checkpoint of the other kind does).

    Outside ``fc.autocast`` (or with ``enabled=False``) it computes exactly what
    ``nn.Linear`` does. Inside, forward, dgrad and wgrad GEMMs take quantized operands
    (``recipe`` decides the formats); the bias is added in FP32, and the output has the
    input's dtype, or ``torch.autocast``'s when that is active too. Dtypes follow
    ``nn.Linear``'s rules: input, weight and bias must share one unless ``torch.autocast``
    is on for the input's device. Any number of tokens (leading dims) works: where a
    recipe's backward needs the token count to be a multiple of its block (32 for MXFP8,
    16 for NVFP4), the input is padded with zero rows, and the padding never reaches the
    output or the gradients. Errors raised in a quantized forward name the layer (its
    qualified name when ``fc.convert`` made it).

    It subclasses ``nn.Linear``, as torchao's ``Float8Linear`` does, so that code testing
    ``isinstance(m, nn.Linear)`` (weight initialisation in Hugging Face models, PEFT/LoRA
    wrapping, parallelisation plans) keeps treating it as a linear layer; code that tests
    ``type(m) is nn.Linear`` (``fc.convert`` itself) does not. Code that reads ``m.weight``
    and calls ``F.linear`` itself, as ``nn.MultiheadAttention`` does with its output
    projection, bypasses the quantized GEMMs, as it would bypass any ``forward``.

    ``forward(x, is_first_microbatch=None)``: ``True`` quantizes the weight and keeps
    it, ``False`` reuses the kept one for the following micro-batches of the step; the
    kept weight is dropped as soon as the weight changes (its version counter moves, or
    any optimizer steps: fused optimizers leave the version counter alone), or another
    weight object is set (FSDP2 does at every gather and reshard: the weight is kept
    across micro-batches while FSDP2 keeps it gathered).
    """

    # Qualified name in the model fc.convert swapped this layer into (error messages).
    _fc_name: str | None = None
    # Whether the weight parameter is stored [in, out] (fc.Conv1D): the GEMMs take its
    # transposed view, so the numerics are those of a Linear with that weight.
    _fc_transposed: bool = False
    # Given a sequence-sharded input DTensor, the layer all-gathers it itself, quantized
    # where it can (``QuantizedColwiseParallel`` hands it over as it is).
    fc_gathers_sharded_input: bool = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        # nn.Linear's parameters and initialisation (reset_parameters), then our runtime.
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_runtime()

    def _init_runtime(self) -> None:
        # Runtime-only state: rebuilt after pickling, never part of the state dict.
        self._plan: Plan | None = None
        self._weight_cache = WeightCache()
        # Per-module state of stateful schemes (schemes.base.ModuleState values; delayed
        # scaling keeps one per direction), saved in the extra state.
        self._scheme_state: dict[Any, ModuleState] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":
            # Another weight object: the kept quantized weight is not its. (FSDP2 swaps
            # the gathered weight in before a forward and the sharded one back after;
            # each gather writes the unsharded weight keeping its version counter, often
            # into the same memory, so the cache's own test cannot see the new values.
            # FSDP2 swaps with setattr on a module that defines __setattr__.)
            cache = self.__dict__.get("_weight_cache")
            if cache is not None and value is not self._parameters.get("weight"):
                cache.clear()
        super().__setattr__(name, value)

    def _get_name(self) -> str:
        # What repr prints: fastcast.Linear(in_features=.., out_features=.., bias=..).
        return "fastcast.Linear"

    # -- the hot path ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        frame = get_stack()[0]
        params = self._parameters  # direct: nn.Module.__getattr__ is a slow fallback
        weight, bias = params["weight"], params["bias"]
        if self._fc_transposed:  # fc.Conv1D keeps its weight as [in, out]
            weight = weight.t()
        replay = record = None
        region = checkpoint_region(frame.active)
        if region is not None:  # activation checkpointing: record, or replay the original
            frame, replay, record = checkpointed_call(self, frame, *region)
        if not frame.enabled:
            if x.__class__ is not torch.Tensor and is_dtensor(x):
                # QuantizedColwiseParallel leaves a sequence-sharded input to the layer,
                # which gathers it, in high precision here (as ColwiseParallel would).
                x = _tensor_parallel().replicated_input(x, weight)
            if frame.calibrating and replay is None:
                self._calibrate(x, weight, frame)
            return F.linear(x, weight, bias)
        mark_ran(frame)  # fc.autocast warns at exit when no layer ran in it

        # Errors below name the layer (see _where); the try costs nothing when none is raised.
        try:
            _check_features(x, self.in_features)
            if x.dtype is not weight.dtype or (bias is not None and bias.dtype is not weight.dtype):
                _check_dtypes(x, weight, bias)
            if x.numel() == 0:  # nothing to quantize (an MoE expert without tokens, say)
                return F.linear(x, weight, bias)
            if weight.__class__ is not nn.Parameter and is_dtensor(weight):
                # Tensor parallel (parallelize_module): GEMMs on the local shards.
                return _tensor_parallel().linear_forward(
                    self, x, weight, bias, frame, is_first_microbatch, replay, record
                )
            plan = plan_for(self, frame, weight)
            cache = self._weight_cache
            return linear_gemms(x, weight, bias, plan, cache, is_first_microbatch, replay, record)
        except _NAMED as exc:
            if type(exc) in _NAMED:  # subclasses (out of memory, say) pass through as they are
                raise type(exc)(f"{self._where()}: {exc}") from exc
            raise

    def _where(self, key: str | None = None) -> str:
        """The layer, for error messages: its name in the model fc.convert saw, if any,
        and the state-dict ``key`` being loaded."""
        features = f"in_features={self.in_features}, out_features={self.out_features}"
        name = self._fc_name
        where = f"fc.Linear {name!r} ({features})" if name else f"fc.Linear({features})"
        return where if key is None else f"{where} at {key!r}"

    def _calibrate(self, x: torch.Tensor, weight: torch.Tensor, frame: AutocastFrame) -> None:
        """High-precision run that lets stateful schemes record what they need."""
        if weight.__class__ is not nn.Parameter and is_dtensor(weight):
            _tensor_parallel().calibrate(self, x, weight, frame)
            return
        plan_for(self, frame, weight).calibrate(x, weight)


# Exceptions forward re-raises with the layer's name in front (exact types only).
_NAMED = (ValueError, TypeError, RuntimeError)


def _check_features(x: torch.Tensor, in_features: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != in_features:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"expects input [..., {in_features}], got {shape}")
    check_input(x)


def _check_dtypes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """nn.Linear's rule for dtypes that differ: fine under torch.autocast for the input's
    device type (which casts them), a RuntimeError otherwise."""
    if torch.is_autocast_enabled(x.device.type):
        return
    if x.dtype is not weight.dtype:
        raise RuntimeError(
            f"mat1 and mat2 must have the same dtype, but got {x.dtype} (input) and "
            f"{weight.dtype} (weight), as nn.Linear requires outside torch.autocast"
        )
    raise RuntimeError(
        f"bias and weight must have the same dtype, but got {bias.dtype} (bias) and "
        f"{weight.dtype} (weight), as nn.Linear requires outside torch.autocast"
    )


def _tensor_parallel() -> Any:
    """``nn.tensor_parallel``, imported on first use (it needs DTensor)."""
    from . import tensor_parallel  # noqa: PLC0415 - torch.distributed.tensor

    return tensor_parallel
