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

DelayedScaling runs in a compiled model under an autocast entered in eager around it,
and trains exactly as in eager. The graph reads each layer's scales and max-accumulates
its amaxes into the layer's amax slots in place (views into the per-thread slabs, graph
inputs fetched per call, so a slab that grows and re-points them is followed); the
updates themselves stay in eager. While tracing, ``_join_delayed`` runs for real: it
attaches the layer's metas to the thread's slabs as eager ``plan_for`` would, marks those
slabs compiled (every forward or backward update then includes them, since a graph
cannot mark them pending; a slab column that recorded nothing does not move), and hooks
the layer's weight (or bias) gradient, which calls ``backward_ran`` from the engine as
the eager Function's backward does, so the backward update runs when the pass ends. The
forward update is the eager autocast exit's, as before. A scale is read through an
opaque copy (``_snapshot``) so that backward never recomputes from a scale the exit has
since moved. Calibration (``calibrating=True``) records as in eager. Refused by name,
before anything changes: an ``fc.autocast(recipe=DelayedScaling(...))`` entered inside a
compiled function (its update would be traced into the graph), delayed scaling inside
a checkpointed region (its recomputation would use moved scales), an
``amax_reduction_group``, and, with grad enabled, a layer with no parameter that
requires grad (nothing to hook). A layer that joins a slab between a compiled forward and
its backward re-points the views that backward already holds: that step's backward amaxes
of the compiled layers are then lost (layers normally join at their first forward).

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
from torch._dynamo.comptime import comptime

from . import gemm, hardware
from . import state as _state
from .delayed import BACKWARD, FORWARD
from .distributed import all_reduce_max
from .kernels import choice as _kernel_choice
from .nn.linear import plan_for
from .nn.weight_cache import WeightCache, quantize_weight
from .quantize.base import scale_and_cast
from .quantize.tensorwise import DelayedScalingQuantizer, record_amax
from .recipe import ELEMENT_MAX, DelayedScaling
from .recompute import checkpoint_region
from .schemes import Plan, Scheme, scheme_for
from .schemes.delayed import DelayedScalingScheme
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
    if isinstance(scheme, DelayedScalingScheme):
        return _traced_delayed_plan(module, frame)
    if type(scheme).plan is not Scheme.plan:  # another stateful scheme
        raise RuntimeError(
            f"fastcast: {type(frame.recipe).__name__} does not run under torch.compile "
            "(its per-module state is updated outside the graph); use "
            "Float8CurrentScaling, or run this model in eager"
        )
    return scheme.plan(frame, {}, weight.device)


def _traced_delayed_plan(module: Any, frame: AutocastFrame) -> Plan:
    """Delayed scaling in a graph: quantizers over the module's metas, whose scale and
    amax views the graph reads and writes in place (graph inputs, fetched each call). The
    updates stay in eager: the autocast exit and a gradient hook start them."""
    recipe = frame.recipe
    if frame.group is not None:
        raise RuntimeError(
            "fastcast: DelayedScaling with an amax_reduction_group does not run under "
            "torch.compile yet; compile without the group, or run that part in eager"
        )
    comptime(_refuse_subgraph)
    if _entered_in_graph():  # refused before joining: a refused trace changes nothing
        raise RuntimeError(_INSIDE)
    # The recipe goes by value (its type and fields): an equal recipe does not recompile.
    _join_delayed(module, type(recipe), recipe._values)
    fwd, bwd = module._metas[FORWARD], module._metas[BACKWARD]
    # Guards on these objects' identities: a module given new metas (a checkpoint load)
    # or moved to another slab is traced, and so joined, again.
    _identities(fwd, bwd, fwd.slab, bwd.slab)
    fmt = recipe.fp8_format
    quantizers = (
        _TracedDelayedQuantizer(fwd, 0, fmt.fwd),
        _TracedDelayedQuantizer(fwd, 1, fmt.fwd),
        _TracedDelayedQuantizer(bwd, 0, fmt.bwd),
    )
    return _TracedDelayedPlan(recipe, None, quantizers)


class _TracedDelayedPlan(Plan):
    """The base Plan's per-call hooks, which do nothing (the eager ones mark slabs pending
    and queue the backward's end: the joined slabs and the hook do that instead), and
    calibration, which records into the forward amax slots as eager's does."""

    __slots__ = ()

    def calibrate(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        slots = self.input_q.meta.amax_slots
        record_amax(slots[0], x.detach())
        record_amax(slots[1], weight.detach())


_INSIDE = (
    "fastcast: fc.autocast(recipe=DelayedScaling(...)) cannot be entered inside a compiled "
    "function; enter it in eager around the compiled model (torch.compile(model)), or use "
    "Float8CurrentScaling"
)


def _entered_in_graph() -> bool:
    """Whether the innermost autocast was entered in the traced code: the stack the
    trace sees is deeper than the eager one it started from."""
    depth, node = 0, _state.get_stack()
    while node is not None:
        depth, node = depth + 1, node[1]
    return depth > _eager_depth()


@assume_constant_result
def _eager_depth() -> int:
    # Runs for real while tracing: the eager stack's depth then (which the guards on the
    # traced stack keep valid for the graph).
    depth, node = 0, _compiled.stack
    while node is not None:
        depth, node = depth + 1, node[1]
    return depth


def _refuse_subgraph(ctx: Any) -> None:
    """At trace time: refuse delayed scaling in a higher-order op's body (activation
    checkpointing), whose recomputation in backward would quantize with scales that
    have moved on since the forward (eager replays the forward's; a graph cannot)."""
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    if tx.output.current_tracer.parent is not None:
        raise RuntimeError(
            "fastcast: DelayedScaling does not run inside activation checkpointing "
            "(or another higher-order op) under torch.compile; checkpoint in eager, or "
            "use Float8CurrentScaling"
        )


class _TracedThreadState:
    """The thread state an autocast exit traced into a graph sees: the delayed-scaling
    update it would start (Python bookkeeping and in-place slab updates, which a graph
    cannot replay per call) is refused where the exit ends a DelayedScaling step. Other
    recipes' exits leave any pending update to the next exit in eager."""

    def __init__(self) -> None:
        self.schemes = {DelayedScalingScheme: self}

    def frame_exited(self, frame: AutocastFrame, below: Stack, ok: bool) -> None:
        if isinstance(frame.recipe, DelayedScaling) and frame.opens_step(below):
            raise RuntimeError(_INSIDE)


_traced_thread_state = _TracedThreadState()


@torch.compiler.substitute_in_graph(_state.thread_state, skip_signature_check=True)
def _traced_thread_state_of() -> Any:
    return _traced_thread_state


class _TracedDelayedQuantizer(DelayedScalingQuantizer):
    """``DelayedScalingQuantizer`` reading its scale through ``_snapshot``."""

    __slots__ = ()

    @property
    def scale(self) -> torch.Tensor:
        return _snapshot(self.meta.scale_views[self.index])


@torch.library.custom_op("fastcast::snapshot", mutates_args=())
def _snapshot(scale: torch.Tensor) -> torch.Tensor:
    """A copy of a delayed scale, opaque to the partitioner. Backward must use the
    values forward quantized with, but the scale changes in place when the autocast
    exits, between the two: with the plain view, the partitioner would save the scale
    itself (an input, free to keep) and recompute from it in backward (autograd then
    refuses the modified tensor). It cannot recompute a custom op, so it saves this."""
    return scale.clone()


@_snapshot.register_fake
def _(scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(scale)


@assume_constant_result
def _join_delayed(module: Any, recipe_type: type[DelayedScaling], values: tuple) -> bool:
    """Runs for real while tracing (``module`` is guarded by identity): attach the
    module's metas to this thread's slabs, once per trace (see ``join_compiled``)."""
    recipe = recipe_type(*values)  # equal to the frame's recipe: the same slabs
    params = [p for p in (module.weight, module.bias) if p is not None]
    scheme_for(recipe).join_compiled(AutocastFrame(True, recipe), module._metas, params)
    return True


@assume_constant_result
def _identities(*objects: Any) -> bool:
    """Runs while tracing; its arguments get identity guards."""
    return True


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


@torch.compiler.substitute_in_graph(_kernel_choice.fused_op, skip_signature_check=True)
def _traced_fused_op(name: str, x: torch.Tensor) -> Any:
    # A graph traces the reference quantize, which Inductor fuses with its neighbours
    # (the eager C++ operator would be one opaque call in the graph, and its first use
    # may build the library).
    return None
