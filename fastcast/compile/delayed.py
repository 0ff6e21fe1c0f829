"""DelayedScaling in a compiled model under an autocast entered in eager around it.

The scales update as in eager, step for step, with values equal to FP32 rounding (bit
for bit where the compiled arithmetic around the layers rounds as eager's). The graph
reads each layer's scales and max-accumulates its amaxes into the layer's amax slots in
place (views into the per-thread slabs, graph inputs fetched per call, so a slab that
grows and re-points them is followed); the updates themselves stay in eager. While
tracing, ``_join_delayed`` runs for real: it attaches the layer's metas to the thread's
slabs as eager ``plan_for`` would, marks those slabs compiled (every forward or backward
update then includes them, since a graph cannot mark them pending; a slab column that
recorded nothing does not move), and hooks the layer's weight (or bias) gradient, which
calls ``backward_ran`` from the engine as the eager Function's backward does, so the
backward update runs when the pass ends. The forward update is the eager autocast
exit's, as before. A scale is read through an opaque copy (``_snapshot``) so that
backward never recomputes from a scale the exit has since moved. Calibration
(``calibrating=True``) records as in eager.

Refused by name, before anything changes: an ``fc.autocast(recipe=DelayedScaling(...))``
entered inside a compiled function (its update would be traced into the graph), delayed
scaling inside a checkpointed region (its recomputation would use moved scales), an
``amax_reduction_group``, and, with grad enabled, a layer with no parameter that requires
grad (nothing to hook). A layer that joins a slab between a compiled forward and its
backward re-points the views that backward already holds: that step's backward amaxes
of the compiled layers are then lost (layers normally join at their first forward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo import assume_constant_result
from torch._dynamo.comptime import comptime

from ..quantizers.tensorwise import record_amax
from ..recipe import Recipe
from ..runtime import state as _state
from ..runtime.state import AutocastFrame, Stack
from ..schemes import Plan, scheme_for
from ..schemes.delayed.owners import DelayedThreadState
from ..schemes.delayed.state import BACKWARD, FORWARD


def traced_delayed_plan(module: Any, frame: AutocastFrame) -> Plan:
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
        # Raised while tracing rather than traced: Dynamo reports an exception raised by
        # the traced code as its own "Observed exception" with ours buried in its debug
        # context; one raised by a comptime function reaches the caller as it is.
        comptime(_refuse_inside)
    # The recipe goes by value (its type and fields): an equal recipe does not recompile.
    _join_delayed(module, type(recipe), recipe._values)
    fwd, bwd = module._scheme_state[FORWARD], module._scheme_state[BACKWARD]
    # Guards on these objects' identities: a module given new metas (a checkpoint load)
    # or moved to another slab is traced, and so joined, again.
    _identities(fwd, bwd, fwd.slab, bwd.slab)
    # The scales read through _snapshot (see there).
    quantizers = scheme_for(recipe).traced_quantizers(recipe, module._scheme_state, _snapshot)
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


def _refuse_inside(ctx: Any) -> None:
    raise RuntimeError(_INSIDE)


def _entered_in_graph() -> bool:
    """Whether the innermost autocast was entered in the traced code: the stack the
    trace sees is deeper than the eager one it started from."""
    return _depth(_state.get_stack()) > _eager_depth()


@assume_constant_result
def _eager_depth() -> int:
    # Runs for real while tracing: the depth of the calling context's stack (which the
    # guards on the traced stack keep valid for the graph).
    return _depth(_state.get_stack())


def _depth(node: Stack | None) -> int:
    """How many frames ``node`` holds (``OUTSIDE`` included)."""
    depth = 0
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
        self.schemes = {DelayedThreadState: self}

    def frame_exited(self, frame: AutocastFrame, below: Stack, ok: bool) -> None:
        if scheme_for(frame.recipe).stateful and frame.opens_step(below):
            raise RuntimeError(_INSIDE)


_traced_thread_state = _TracedThreadState()


@torch.compiler.substitute_in_graph(_state.thread_state, skip_signature_check=True)
def _traced_thread_state_of() -> Any:
    return _traced_thread_state


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
def _join_delayed(module: Any, recipe_type: type[Recipe], values: tuple) -> bool:
    """Runs for real while tracing (``module`` is guarded by identity): attach the
    module's metas to this thread's slabs, once per trace (see ``join_compiled``)."""
    recipe = recipe_type(*values)  # equal to the frame's recipe: the same slabs
    params = [p for p in (module.weight, module.bias) if p is not None]
    scheme_for(recipe).join_compiled(AutocastFrame(True, recipe), module._scheme_state, params)
    return True


@assume_constant_result
def _identities(*objects: Any) -> bool:
    """Runs while tracing; its arguments get identity guards."""
    return True
