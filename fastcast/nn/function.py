"""The autograd Function behind ``fc.Linear``, and what it captures per call.

Forward quantizes input and weight and saves only their column-wise (transposed) FP8
layouts; backward quantizes the gradient and runs dgrad and wgrad as scaled GEMMs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..delayed import BACKWARD, FORWARD
from ..gemm import scaled_mm
from ..profiling import annotate
from ..quantize.tensorwise import FixedScaleQuantizer
from ..state import claim_step_start
from ..tensor import QuantizedTensor
from .plan import Plan

if TYPE_CHECKING:
    from .linear import Linear


class StepInfo:
    """Per-call choices that backward needs, captured at forward time (backward may run on
    another thread, after the autocast has exited and the scales have moved on)."""

    __slots__ = (
        "plan",
        "input_q",
        "weight_q",
        "grad_q",
        "is_first_microbatch",
        "ends_step",
        "registry",
        "replay_entry",
        "replayed_weight",
    )

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


class LinearFunction(torch.autograd.Function):
    """FP8 forward and both backward GEMMs, saving only quantized operands."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: Linear,
        step: StepInfo,
    ) -> torch.Tensor:
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        out, x_q, w_q = module._forward_gemm(x, weight, bias, step, need_dgrad, need_wgrad)
        # Backward contracts over the other dim of each operand: keep only the
        # column-wise layouts, in FP8, flattened to tensors so saved-tensor hooks see them.
        saved = [
            x_q.columnwise_operand() if need_wgrad else None,
            w_q.columnwise_operand() if need_dgrad else None,
        ]
        tensors, ctx.shells = _strip_tensors(saved)
        ctx.save_for_backward(*tensors)
        ctx.step = step
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    @annotate("fastcast.Linear.backward")
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        x_t, w_t = _restore_tensors(ctx.saved_tensors, ctx.shells)
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


def _strip_tensors(
    items: list[QuantizedTensor | None],
) -> tuple[list[torch.Tensor], list[tuple[QuantizedTensor, list[str]] | None]]:
    """Take the inner tensors out of freshly made operands (for ``save_for_backward``,
    so that saved-tensor hooks see them); the tensor-free shells stay on ``ctx``."""
    tensors: list[torch.Tensor] = []
    shells: list[tuple[QuantizedTensor, list[str]] | None] = []
    for item in items:
        if item is None:
            shells.append(None)
            continue
        names = [n for n in item.inner_names if getattr(item, n) is not None]
        for name in names:
            tensors.append(getattr(item, name))
            setattr(item, name, None)
        shells.append((item, names))
    return tensors, shells


def _restore_tensors(tensors: tuple[torch.Tensor, ...], shells: list) -> list[Any]:
    """Put the (possibly unpacked by hooks) saved tensors back into their shells."""
    out: list[Any] = []
    it = iter(tensors)
    for shell in shells:
        if shell is None:
            out.append(None)
            continue
        item, names = shell
        for name in names:
            setattr(item, name, next(it))
        out.append(item)
    return out
