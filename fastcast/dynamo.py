"""``torch.compile`` support (Dynamo polyfills): the autocast stack as Dynamo sees it.

Eager autocast keeps its stack in a ``ContextVar``, which Dynamo cannot trace. Instead of
testing ``torch.compiler.is_compiling()`` on the hot path, the two stack accessors
(``state.get_stack``, ``state.set_stack``) get Dynamo polyfills
(``torch.compiler.substitute_in_graph``): eager calls the C accessors as before and pays
nothing; traced code reads and writes ``_compiled.stack``, a per-thread attribute that
Dynamo guards on. An autocast entered inside a compiled function is therefore traced
(its frame, and so its recipe, become guarded constants of the graph).

An autocast entered in eager around a compiled model must be visible to the guards too:
from the first trace that reads the stack on, eager autocast mirrors its stack into
``_compiled.stack`` (one more attribute store per enter and exit, in processes that
compile fastcast code only; eager-only processes never pay it). Compiled code sees the
stack of its thread: under compile the state is per thread, not per asyncio task, and a
thread that was inside an eager autocast when mirroring started is seen by compiled code
only from its next enter or exit.

Two more polyfills are about speed, not tracing: the FP8 cast (``scale_and_cast``) and
the CPU's GEMM choice (``gemm.runs_kernel``) are written the way Inductor fuses best;
each says what it replaces and why. They compute the same values as eager.
"""

from __future__ import annotations

import importlib
import math
import threading
from typing import Any

import torch
from torch._dynamo import assume_constant_result

from . import gemm, hardware
from . import state as _state
from .distributed import all_reduce_max
from .nn.linear import plan_for
from .nn.weight_cache import WeightCache, quantize_weight
from .quantize.base import scale_and_cast
from .recipe import ELEMENT_MAX
from .recompute import checkpoint_region
from .schemes import Plan, Scheme, scheme_for
from .state import BOTTOM, AutocastFrame, Stack
from .tensor import FP8_DTYPES

_autocast_module = importlib.import_module("fastcast.autocast")  # the module, not the class

# The machine's answers are fixed for a trace (the GEMM path depends on the device and on
# FASTCAST_GEMM, read when traced): run them at trace time and keep the answers as
# constants, rather than trace into their lru_caches (which Dynamo warns about). This only
# marks the functions; eager calls are unchanged.
for _answer in (hardware.gemm_backend, hardware.default_device_type):
    assume_constant_result(_answer)


class _CompiledStack(threading.local):
    """Per thread: the autocast stack compiled code sees (guarded by Dynamo)."""

    def __init__(self) -> None:
        # Set per thread (not a class default): Dynamo guards on the instance dict.
        self.stack: Stack = BOTTOM


_compiled = _CompiledStack()


def _set_both(stack: Stack) -> None:
    """``set_stack`` once mirroring is on: the context variable, then the mirror."""
    _state.set_stack(stack)
    _compiled.stack = stack


@assume_constant_result
def _sync_from_eager() -> bool:
    """Runs for real while tracing: from the first trace on, eager autocast mirrors its
    stack (compiled code traced without an autocast must see one entered later)."""
    if _autocast_module.set_stack is not _set_both:
        _autocast_module.set_stack = _set_both
        _compiled.stack = _state.get_stack()
    return True


@torch.compiler.substitute_in_graph(_state.get_stack, skip_signature_check=True)
def _traced_get_stack() -> Stack:
    _sync_from_eager()
    return _compiled.stack


def _traced_set_stack(stack: Stack) -> None:
    _compiled.stack = stack


torch.compiler.substitute_in_graph(_state.set_stack, skip_signature_check=True)(_traced_set_stack)
torch.compiler.substitute_in_graph(_set_both, skip_signature_check=True)(_traced_set_stack)


@torch.compiler.substitute_in_graph(checkpoint_region, skip_signature_check=True)
def _traced_checkpoint_region(active: bool) -> None:
    # Dynamo traces torch.utils.checkpoint regions as a higher-order op whose recomputation
    # is part of the compiled graph: nothing to record or replay here.
    return None


@torch.compiler.substitute_in_graph(plan_for, skip_signature_check=True)
def _traced_plan_for(module: Any, frame: AutocastFrame, weight: torch.Tensor) -> Plan:
    # Built afresh in each trace rather than cached on the module: the quantizers are then
    # functions of the recipe's fields, which Dynamo guards by value (an equal recipe does
    # not recompile), and the module is not mutated.
    scheme = scheme_for(frame.recipe)
    if type(scheme).plan is not Scheme.plan:  # a stateful scheme (delayed scaling)
        raise RuntimeError(
            f"fastcast: {type(frame.recipe).__name__} does not run under torch.compile yet "
            "(its per-module state is updated outside the graph); use "
            "Float8CurrentScaling, or run this model in eager"
        )
    return scheme.plan(frame, {}, weight.device)


@torch.compiler.substitute_in_graph(quantize_weight, skip_signature_check=True)
def _traced_weight_quantize(
    cache: WeightCache, weight: torch.Tensor, quantizer: Any, first: Any, columnwise: bool
) -> Any:
    # The micro-batch cache is an eager optimisation: a compiled graph quantizes the weight
    # on every call (fused with its neighbours), which gives what the cache would hold.
    return quantizer.quantize(weight, rowwise=True, columnwise=columnwise)


@torch.compiler.substitute_in_graph(all_reduce_max, skip_signature_check=True)
def _traced_all_reduce_max(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    # A graph would have to hold the process group (guarding on its identity) and issue a
    # collective inside every quantize: refused, clearly, until that is designed.
    raise RuntimeError(
        "fastcast: amax reduction over a process group (amax_reduction_group) does not run "
        "under torch.compile yet; compile without it, or run that part in eager"
    )


@torch.compiler.substitute_in_graph(scale_and_cast, skip_signature_check=True)
def _traced_scale_and_cast(x: torch.Tensor, scale: Any, fmt: str) -> torch.Tensor:
    # The same values as eager's scale_and_cast, written for a compiler: eager saves
    # passes with in-place ops and by adding infinity masks to the E5M2 bytes through a
    # uint8 view of a dead buffer, which Inductor turns into slow, unfused index
    # arithmetic (1.7 ms per 256x128 tensor). One select fuses with the cast instead.
    fmt_max = ELEMENT_MAX[fmt]
    y = x.float()
    data = (y * scale).clamp(-fmt_max, fmt_max)  # NaN stays NaN through the clamp
    # An input infinity (which the clamp made +-max) stays infinite in E5M2; E4M3
    # (float8_e4m3fn) has none, so it becomes NaN there, as in eager.
    infinite = y.abs() == math.inf
    data = torch.where(infinite, math.nan if fmt == "e4m3" else y, data)
    return data.to(FP8_DTYPES[fmt])


@torch.compiler.substitute_in_graph(gemm.runs_kernel, skip_signature_check=True)
def _traced_runs_kernel(a: Any, b: Any, device_type: str) -> bool:
    # A CPU has no FP8 units: torch._scaled_mm's CPU kernel converts both operands to FP32
    # in separate passes, then multiplies. The emulation computes the same product (FP32
    # operands, FP32 accumulation, to FP32 rounding) in a form Inductor fuses: each
    # operand's conversion joins the kernel that quantized it. On the train_step
    # benchmark that is 15 ms a step against 25 ms. Other devices keep their kernels.
    if device_type == "cpu":
        return False
    return device_type != "cuda" or gemm._fits_cuda_kernel(a, b)
