"""``fc.Linear``: ``nn.Linear`` whose GEMMs run in FP8/FP4 inside ``fc.autocast``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import decode_extra_state, encode_extra_state
from ..delayed import BACKWARD, FORWARD, ScalingMeta
from ..gemm import scaled_mm
from ..profiling import annotate
from ..quantize.base import check_input
from ..quantize.tensorwise import FixedScaleQuantizer, record_amax
from ..state import claim_step_start, get_thread_state, optimizer_steps, thread_state
from ..tensor import QuantizedTensor
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
    kept weight is dropped as soon as the weight changes (its version counter moves).
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
        self._weight_cache: tuple[QuantizedTensor, int, Plan] | None = None
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
        weight, bias = self.weight, self.bias
        if not frame.enabled:
            if frame.calibrating:
                self._calibrate(x, weight, frame, ts)
            return F.linear(x, weight, bias)

        _check_features(x, self.in_features)
        if x.numel() == 0:  # nothing to quantize (an MoE expert without tokens, say)
            return F.linear(x, weight, bias)
        plan = self._plan
        if plan is None or not plan.matches(frame, ts):
            plan = self._plan = build_plan(frame, ts, self._metas, weight.device)
        autograd = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        step = _StepInfo(plan, ts, is_first_microbatch, autograd)
        if autograd:
            return _LinearFunction.apply(x, weight, bias, self, step)
        return self._forward_gemm(x, weight, bias, step, need_dgrad=False, need_wgrad=False)[0]

    def _forward_gemm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        step: _StepInfo,
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
        self, weight: torch.Tensor, step: _StepInfo, columnwise: bool
    ) -> QuantizedTensor:
        if step.replayed_weight is not None:
            return step.replayed_weight
        cache = self._weight_cache
        first = step.is_first_microbatch
        if first is False and cache is not None:
            w_q, version, plan = cache
            # Reuse only what was quantized from this very weight under this plan, with
            # no optimizer step since (fused optimizers leave the version counter alone).
            if version == (weight._version, optimizer_steps()) and plan is step.plan and (
                w_q.has_columnwise or not columnwise
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
        plan = self._plan
        if plan is None or not plan.matches(frame, ts):
            plan = self._plan = build_plan(frame, ts, self._metas, weight.device)
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


class _StepInfo:
    """Per-call choices that backward needs, captured at forward time (backward may run on
    another thread, after the autocast has exited and the scales have moved on)."""

    __slots__ = ("plan", "input_q", "weight_q", "grad_q", "is_first_microbatch", "ends_step",
                 "registry", "replay_entry", "replayed_weight")

    def __init__(
        self, plan: Plan, ts: Any, is_first_microbatch: bool | None, autograd: bool
    ) -> None:
        self.plan = plan
        self.is_first_microbatch = is_first_microbatch
        self.input_q, self.weight_q, self.grad_q = plan.input_q, plan.weight_q, plan.grad_q
        self.registry = plan.registry
        self.ends_step = False
        self.replay_entry = self.replayed_weight = None
        if plan.registry is None:
            return
        replay = ts.replay
        if replay is not None and not replay.recording:
            self._replay(replay.pop())
            return
        if replay is not None:  # a checkpointed forward: keep what the replay will need
            self.replay_entry = [plan.fwd_meta.scale.clone(), None]
            replay.push(self.replay_entry)
        # Only a module whose backward will run can end the step's backward.
        self.ends_step = autograd and claim_step_start(ts)

    def _replay(self, entry: list) -> None:
        """Under activation recomputation: the original forward's input scale and the very
        weight it used (possibly cached from an earlier micro-batch); record nothing."""
        scale, self.replayed_weight = entry
        self.input_q = FixedScaleQuantizer(scale[0:1], self.plan.recipe.fp8_format.fwd)
        self.is_first_microbatch = None
        self.registry = None

    def remember_weight(self, w_q: QuantizedTensor) -> QuantizedTensor:
        if self.replay_entry is not None:
            self.replay_entry[1] = w_q
        return w_q

    def mark_forward(self) -> None:
        if self.registry is not None:
            self.registry.mark(self.plan.fwd_slab, FORWARD)

    def mark_backward(self) -> None:
        registry = self.plan.registry
        if registry is not None:
            registry.mark(self.plan.bwd_slab, BACKWARD)
            if self.ends_step:
                registry.end(BACKWARD, self.plan.group)


class _LinearFunction(torch.autograd.Function):
    """FP8 forward and both backward GEMMs, saving only quantized operands."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any, module: Linear,
                step: _StepInfo) -> torch.Tensor:
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        out, x_q, w_q = module._forward_gemm(x, weight, bias, step, need_dgrad, need_wgrad)
        # Backward contracts over the other dim of each operand: keep only the
        # column-wise layouts, in FP8, flattened to tensors so saved-tensor hooks see them.
        saved = [x_q.columnwise_operand() if need_wgrad else None,
                 w_q.columnwise_operand() if need_dgrad else None]
        tensors, ctx.layouts = _flatten_saved(saved)
        ctx.save_for_backward(*tensors)
        ctx.step = step
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    @annotate("fastcast.Linear.backward")
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        x_t, w_t = _unflatten_saved(ctx.saved_tensors, ctx.layouts)
        step = ctx.step
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        g2d = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
        dgrad = wgrad = bgrad = None
        if need_dgrad or need_wgrad:
            g_q = step.grad_q.quantize(g2d, rowwise=need_dgrad, columnwise=need_wgrad)
        if need_dgrad:  # [M, N] @ [N, K]
            dgrad = scaled_mm(g_q, w_t, out_dtype=x_dtype)
            if len(x_shape) != 2:
                dgrad = dgrad.reshape(x_shape)
        if need_wgrad:  # [N, M] @ [M, K]
            wgrad = scaled_mm(g_q.columnwise_operand(), x_t, out_dtype=w_dtype)
        if need_bgrad:
            bgrad = g2d.sum(dim=0, dtype=torch.float32)
            if b_dtype != torch.float32:
                bgrad = bgrad.to(b_dtype)
        step.mark_backward()
        return dgrad, wgrad, bgrad, None, None


def _flatten_saved(items: list[QuantizedTensor | None]) -> tuple[list[torch.Tensor], list]:
    tensors: list[torch.Tensor] = []
    layouts: list = []
    for item in items:
        if item is None:
            layouts.append(None)
            continue
        names, meta = item.__tensor_flatten__()
        layouts.append((type(item), names, meta, len(tensors)))
        tensors.extend(getattr(item, n) for n in names)
    return tensors, layouts


def _unflatten_saved(tensors: tuple[torch.Tensor, ...], layouts: list) -> list[Any]:
    out = []
    for layout in layouts:
        if layout is None:
            out.append(None)
            continue
        cls, names, meta, start = layout
        inner = dict(zip(names, tensors[start : start + len(names)]))
        out.append(cls.__tensor_unflatten__(inner, meta))
    return out


def _check_features(x: torch.Tensor, in_features: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != in_features:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"fc.Linear(in_features={in_features}) expects input [..., {in_features}], "
            f"got {shape}"
        )
    check_input(x)


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
