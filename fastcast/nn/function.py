"""The linear GEMMs of ``fc.Linear``, ``fc.Conv1D`` and their tensor-parallel shards:
``linear_gemms`` (the no-grad path, the token padding, the autograd Function) and the
one autograd Function, ``LinearFunction``.

Forward quantizes input and weight and saves only their column-wise (transposed) FP8
layouts; backward quantizes the gradient and runs dgrad and wgrad as scaled GEMMs. A
sequence-parallel input comes with a gather (``GatheredInput``): the Function then takes
the whole input's operand from it and hands the input gradient back to it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..distributed.agreement import agree
from ..gemm import operands_product
from ..runtime.observers import BACKWARD_RANGE, begin, end, observe_plan
from ..runtime.observers import attached as _observers
from ..runtime.state import AutocastFrame
from ..schemes import Plan, scheme_for
from ..tensor import QuantizedTensor
from .weight_cache import WeightCache, quantize_weight


class GatheredInput(Protocol):
    """The hook for an input gathered across ranks before the GEMMs (sequence parallelism:
    ``sequence_parallel.InputGather``). The Function calls it, never the module."""

    def quantize(
        self, x: torch.Tensor, quantizer: Any, columnwise: bool
    ) -> tuple[QuantizedTensor, QuantizedTensor | None]:
        """The whole input's row-wise operand from ``x``, this rank's part, and (with
        ``columnwise``) what backward needs for the weight gradient (``columns``)."""
        ...

    def columns(self, x_t: QuantizedTensor) -> QuantizedTensor:
        """The whole input's column-wise operand from what ``quantize`` returned."""
        ...

    def scatter(self, dgrad: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole input's gradient ``dgrad`` (a partial sum)."""
        ...


def plan_for(module: Any, frame: AutocastFrame, weight: torch.Tensor, sharding: Any = None) -> Plan:
    """``module``'s plan for the frame's (recipe, group), rebuilt only when it, or the
    tensor-parallel ``sharding`` (``tensor_parallel.Sharding``: its ``plan`` builds the
    plan of the local shards) changes. ``module``: an ``fc.Linear``.

    (A function, not a method, so that ``fastcast.compile`` can give compiled code its own.)
    """
    plan = module._plan
    if plan is None or not plan.matches(frame) or plan.sharding != sharding:
        if frame.group is not None:  # the amaxes are reduced: ranks must agree on the recipe
            agree(frame.recipe, weight.device, "the amax reduction", frame.group)
        if sharding is None:
            plan = scheme_for(frame.recipe).plan(frame, module._scheme_state, weight.device)
        else:
            plan = sharding.plan(module, frame, weight)
        plan.sharding = sharding
        module._plan = plan
    if _observers:  # the state manager's observer point (fc.inspect): one test when none
        return observe_plan(module, frame, plan)
    return plan


def linear_gemms(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: Any,
    cache: WeightCache,
    first: bool | None,
    replay: Any = None,
    record: Any = None,
    gather: GatheredInput | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` under ``plan`` (``schemes.base.Plan``): the forward GEMM
    alone without autograd, else ``LinearFunction``, over the tokens padded with zero rows
    to the plan's row alignment where the weight gradient needs it."""
    autograd = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    call = plan.call(autograd, replay, record)
    if not autograd:
        x_q = None if gather is None else gather.quantize(x, call.input_q, False)[0]
        return forward_gemm(x, weight, bias, call, cache, first, False, False, x_q)[0]
    rows = x.numel() // x.shape[-1]
    align = plan.row_alignment
    if rows % align and weight.requires_grad and gather is None:
        # Zero rows: autograd gives the sliced-off rows zero gradients and the pad drops
        # their input gradients; they add nothing to the weight or bias gradients.
        x2d = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % align))
        out = LinearFunction.apply(x2d, weight, bias, call, cache, first, None)[:rows]
        return out.view(*x.shape[:-1], out.shape[-1])
    return LinearFunction.apply(x, weight, bias, call, cache, first, gather)


def forward_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    call: Any,
    weight_cache: WeightCache,
    first: bool | None,
    need_dgrad: bool,
    need_wgrad: bool,
    x_q: QuantizedTensor | None = None,
) -> tuple[torch.Tensor, QuantizedTensor, QuantizedTensor]:
    """Quantize input and weight with ``call``'s quantizers and run the forward GEMM.

    ``call`` is the scheme's per-call object (``schemes.base.Plan.call``); column-wise
    layouts are made only for the backward GEMMs that will run. ``x_q``: the input
    already quantized (a ``GatheredInput``'s), ``x`` then gives only the output dtype.
    """
    if x_q is None:
        x_q = call.input_q.quantize(x, rowwise=True, columnwise=need_wgrad)
    w_q = call.replayed_weight
    if w_q is not None and need_dgrad and not w_q.has_columnwise:
        # A recomputation needs a layout the original (no-grad) call did not make: quantize
        # again, with the replaying call's quantizer (the original scale), bypassing the cache.
        w_q = call.weight_q.quantize(weight, rowwise=True, columnwise=True)
    elif w_q is None:
        # A weight FSDP2 gathered in FP8 (fastcast.distributed.fsdp) is used as it is.
        # (Its type's attribute: Dynamo's hasattr on a tensor does not see the method.)
        if weight.__class__ is torch.nn.Parameter or not hasattr(type(weight), "fc_quantized"):
            w_q = quantize_weight(weight_cache, weight, call.weight_q, first, need_dgrad)
        else:
            w_q = weight.fc_quantized(call.weight_q, need_dgrad)
            if w_q is None:
                w_q = quantize_weight(weight_cache, weight, call.weight_q, None, need_dgrad)
        w_q = call.remember_weight(w_q)
    out = operands_product(x_q, w_q, _output_dtype(x), bias)
    call.forward_done()
    return out, x_q, w_q


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = "cpu" if x.is_cpu else x.device.type  # (no torch.device made per call)
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class LinearFunction(torch.autograd.Function):
    """FP8 forward and both backward GEMMs, saving only quantized operands.

    It receives what it needs (the per-call object, the weight cache, the micro-batch
    flag, the input's gather if any), never the module.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        call: Any,
        weight_cache: WeightCache,
        first: bool | None,
        gather: GatheredInput | None,
    ) -> torch.Tensor:
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # A high-precision wgrad (the plan says) takes x itself: no FP8 x.T to make.
        # (Never with a gather: sequence_parallel gathers such inputs in high precision.)
        hp_wgrad = need_wgrad and call.wgrad_high_precision
        fp8_wgrad = need_wgrad and not hp_wgrad
        x_q = x_t = None
        if gather is not None:
            x_q, x_t = gather.quantize(x, call.input_q, fp8_wgrad)
        out, x_q, w_q = forward_gemm(
            x, weight, bias, call, weight_cache, first, need_dgrad, fp8_wgrad, x_q
        )
        if fp8_wgrad and gather is None:
            x_t = x_q.columnwise_operand()
        # Backward contracts over the other dim of each operand: keep only the
        # column-wise layouts, in FP8, flattened to tensors so saved-tensor hooks see them.
        saved = [x_t, w_q.columnwise_operand() if need_dgrad else None]
        tensors, ctx.shells = _strip_tensors(saved)
        if torch.compiler.is_compiling():
            # A traced autograd Function cannot save views of its intermediates (transposed
            # layouts often are): compiled code saves copies, which Inductor fuses.
            tensors = [t.clone(memory_format=torch.contiguous_format) for t in tensors]
        # The high-precision wgrad's input goes last, and its GEMM's dtype: the forward's.
        ctx.wgrad_dtype = _output_dtype(x) if hp_wgrad else None
        if hp_wgrad:
            tensors.append(x)
        ctx.save_for_backward(*tensors)
        ctx.call, ctx.gather = call, gather
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        if _observers and not torch.compiler.is_compiling():
            # The observer point of the layer's backward range (one test when none is
            # attached); fc.profiling names it in the node's public metadata.
            opened = begin(ctx.metadata.get(BACKWARD_RANGE, "fastcast.Linear.backward"))
            try:
                return _backward(ctx, grad_out)
            finally:
                end(opened)
        return _backward(ctx, grad_out)


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    """``LinearFunction.backward``: the input, weight and bias gradients."""
    x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
    saved = ctx.saved_tensors  # (each access unpacks them again under hooks)
    x_t, w_t = _restore_tensors(saved, ctx.shells)
    call = ctx.call
    need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
    g2d = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
    dgrad = wgrad = bgrad = None
    hp_dtype = ctx.wgrad_dtype
    fp8_wgrad = need_wgrad and hp_dtype is None
    if need_dgrad or fp8_wgrad:
        g_q = call.grad_q.quantize(g2d, rowwise=need_dgrad, columnwise=fp8_wgrad)
    gather = ctx.gather
    if need_dgrad:  # [M, N] @ [N, K]
        dgrad = operands_product(g_q, w_t, x_dtype)
        if gather is not None:
            dgrad = gather.scatter(dgrad)
        elif len(x_shape) != 2:
            dgrad = dgrad.reshape(x_shape)
    if fp8_wgrad:  # [N, M] @ [M, K]
        if gather is not None:
            x_t = gather.columns(x_t)
        wgrad = operands_product(g_q.columnwise_operand(), x_t, w_dtype)
    elif need_wgrad:
        wgrad = _wgrad_high_precision(g2d, saved[-1], hp_dtype, w_dtype)
    if need_bgrad:
        bgrad = bias_grad(g2d, b_dtype)
    call.backward_done()
    return dgrad, wgrad, bgrad, None, None, None, None


def bias_grad(g2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bias gradient: ``g2d``'s column sums, accumulated in FP32, in ``dtype``."""
    bgrad = g2d.sum(dim=0, dtype=torch.float32)
    return bgrad if dtype == torch.float32 else bgrad.to(dtype)


def _wgrad_high_precision(
    g2d: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:
    """``g.T @ x`` in ``dtype`` (the forward's: the input's, or torch.autocast's), as
    nn.Linear's backward computes it, returned in ``out_dtype`` (the weight's)."""
    x2d = x.reshape(-1, x.shape[-1])
    return (g2d.to(dtype).t() @ x2d.to(dtype)).to(out_dtype)


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
        if torch.compiler.is_compiling():  # traced backward may not mutate forward's objects
            item = item._clone_meta()
        for name in names:
            setattr(item, name, next(it))
        out.append(item)
    return out
