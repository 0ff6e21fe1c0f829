"""``fc.Linear``: ``nn.Linear`` whose GEMMs run in FP8/FP4 inside ``fc.autocast``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import decode_extra_state, encode_extra_state
from ..delayed import FORWARD, ScalingMeta
from ..gemm import scaled_mm
from ..profiling import annotate
from ..quantize.base import check_input
from ..quantize.tensorwise import record_amax
from ..state import get_thread_state, optimizer_steps, thread_state
from ..tensor import QuantizedTensor
from .function import LinearFunction, StepInfo
from .plan import Plan, build_plan


class Linear(nn.Module):
    """Drop-in for ``nn.Linear``: same parameters and state-dict keys, plus
    ``_extra_state`` (delayed-scaling amax histories and scales, as plain tensors).

    Outside ``fc.autocast`` (or with ``enabled=False``) it computes exactly what
    ``nn.Linear`` does. Inside, forward, dgrad and wgrad GEMMs take quantized operands
    (``recipe`` decides the formats); the bias is added in FP32, and the output has the
    input's dtype, or ``torch.autocast``'s when that is active too.

    ``forward(x, is_first_microbatch=None)``: ``True`` quantizes the weight and keeps
    it, ``False`` reuses the kept one for the following micro-batches of the step; the
    kept weight is dropped as soon as the weight changes (its version counter moves, or
    any optimizer steps: fused optimizers leave the version counter alone).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self._init_runtime()
        self.reset_parameters()

    def _init_runtime(self) -> None:
        # Runtime-only state: rebuilt after pickling, never part of the state dict.
        self._plan: Plan | None = None
        self._weight_cache: tuple[QuantizedTensor, tuple[int, int], Plan] | None = None
        self._metas: dict[int, ScalingMeta] = {}

    def reset_parameters(self) -> None:
        """The initialisation ``nn.Linear`` uses."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )

    # -- the hot path ---------------------------------------------------------------------
    @annotate("fastcast.Linear.forward")
    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        try:
            ts = get_thread_state()
        except LookupError:
            ts = thread_state()
        frame = ts.frame
        params = self._parameters  # direct: nn.Module.__getattr__ is a slow fallback
        weight, bias = params["weight"], params["bias"]
        if not frame.enabled:
            if frame.calibrating:
                self._calibrate(x, weight, frame, ts)
            return F.linear(x, weight, bias)

        _check_features(x, self.in_features)
        if x.numel() == 0:  # nothing to quantize (an MoE expert without tokens, say)
            return F.linear(x, weight, bias)
        plan = self._plan_for(frame, ts, weight)
        autograd = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        step = StepInfo(plan, ts, is_first_microbatch, autograd)
        if autograd:
            return LinearFunction.apply(x, weight, bias, self, step)
        return self._forward_gemm(x, weight, bias, step, need_dgrad=False, need_wgrad=False)[0]

    def _plan_for(self, frame: Any, ts: Any, weight: torch.Tensor) -> Plan:
        """This module's plan for the frame's (recipe, group), rebuilt only when it changes."""
        plan = self._plan
        if plan is None or not plan.matches(frame, ts):
            plan = self._plan = build_plan(frame, ts, self._metas, weight.device)
        return plan

    def _forward_gemm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        step: StepInfo,
        need_dgrad: bool,
        need_wgrad: bool,
    ) -> tuple[torch.Tensor, QuantizedTensor, QuantizedTensor]:
        """Quantize input and weight and run the forward GEMM."""
        x_q = step.input_q.quantize(x, rowwise=True, columnwise=need_wgrad)
        w_q = self._quantized_weight(weight, step, columnwise=need_dgrad)
        out = scaled_mm(x_q, w_q, out_dtype=_output_dtype(x), bias=bias)
        step.mark_forward()
        return out, x_q, w_q

    def _quantized_weight(
        self, weight: torch.Tensor, step: StepInfo, columnwise: bool
    ) -> QuantizedTensor:
        if step.replayed_weight is not None:
            return step.replayed_weight
        cache = self._weight_cache
        first = step.is_first_microbatch
        if first is False and cache is not None:
            w_q, version, plan = cache
            # Reuse only what was quantized from this very weight under this plan, with
            # no optimizer step since (fused optimizers leave the version counter alone).
            if (
                version == (weight._version, optimizer_steps())
                and plan is step.plan
                and (w_q.has_columnwise or not columnwise)
            ):
                return step.remember_weight(w_q)
        w_q = step.weight_q.quantize(weight, rowwise=True, columnwise=columnwise)
        if first is None:
            self._weight_cache = None
        else:
            version = (weight._version, optimizer_steps(install=True))
            self._weight_cache = (w_q, version, step.plan)
        return step.remember_weight(w_q)

    def _calibrate(self, x: torch.Tensor, weight: torch.Tensor, frame: Any, ts: Any) -> None:
        """High-precision run that records input and weight amaxes for delayed scaling."""
        plan = self._plan_for(frame, ts, weight)
        if plan.delayed:
            record_amax(plan.fwd_meta.amax_slots[0], x.detach())
            record_amax(plan.fwd_meta.amax_slots[1], weight.detach())
            plan.registry.mark(plan.fwd_slab, FORWARD)

    # -- state: _extra_state, device moves, pickling ------------------------------------------
    def get_extra_state(self) -> Any:
        return encode_extra_state(self._metas)

    def set_extra_state(self, state: Any) -> None:
        metas = decode_extra_state(state, owner=type(self).__name__)
        for meta in self._metas.values():
            meta.detach()
        self._metas = metas
        self._plan = None
        self._weight_cache = None

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:
        super()._apply(fn, recurse)
        # Scales stay FP32 whatever dtype the parameters move to; only the device follows.
        for meta in self._metas.values():
            meta.move_to(self.weight.device)
        self._plan = None
        self._weight_cache = None
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_metas"] = {d: m.state() for d, m in self._metas.items()}
        state["_plan"] = None
        state["_weight_cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        metas = state.pop("_metas", {})
        self.__dict__.update(state)
        self._init_runtime()
        self._metas = {d: ScalingMeta.from_state(s) for d, s in metas.items()}


def _check_features(x: torch.Tensor, in_features: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != in_features:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"fc.Linear(in_features={in_features}) expects input [..., {in_features}], got {shape}"
        )
    check_input(x)


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
