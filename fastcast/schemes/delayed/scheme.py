"""``DelayedScaling``: per-tensor FP8 with scales from the amax history of earlier steps.

The one stateful scheme; this module is its scheme, and the overview of everything it
means (in this package):

- per module (saved in its checkpoints): a ``ScalingMeta`` per direction, forward
  (input, weight) and backward (grad_output), whose tensors are column views into one
  ``Slab`` per (autocast key, direction, device) (``state.py``), so an update
  costs a fixed number of tensor operations whatever the number of modules;
- per owner (``DelayedState``, ``owners.py``): the slabs, and which of them recorded amaxes since
  their last update. The owner is the asyncio task running the module, or the thread
  when no task runs (``DelayedThreadState`` holds a thread's owners). A module's metas
  join one owner's slabs; using the module from another owner while the first is alive
  (a live thread, a task not done) is refused, so steps of concurrent tasks never see
  each other's updates; the claim is atomic (``claims``). The thread's own owner
  lends its modules to the tasks of its thread (it cannot run while they do);
- per call (``DelayedPlan``, or ``DelayedCall`` under checkpointing, ``plan.py``): the
  quantizers; under activation checkpointing the input
  scale and quantized weight the original call used, which its recomputation replays;
- lifecycle: forward scales update when the outermost active autocast exits after a
  training (grad-enabled) or calibrating forward; backward scales when the backward pass
  (the autograd graph task) that ran any delayed-scaling module's backward finishes,
  whichever modules it reached. Step k quantizes with the scales from amaxes up to step
  k-1. Compiled code cannot run these hooks: ``join_compiled`` sets up the same updates
  from eager (``fastcast.compile`` tells how).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...quantizers.base import PER_TENSOR_BLOCKS, ROLES, Blocks, Quantizer
from ...quantizers.tensorwise import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    FixedScaleQuantizer,
)
from ...recipe import DelayedScaling
from ...runtime.state import AutocastFrame, thread_state
from ...tensor import TENSORWISE
from ..base import Scheme, register_scheme
from .owners import DelayedState, claims, refuse_concurrent_use
from .plan import DelayedPlan
from .state import BACKWARD, FORWARD, ScalingMeta, ScalingOrigin


@register_scheme(DelayedScaling)
class DelayedScalingScheme(Scheme):
    """Stateful per-tensor FP8; see the module docstring."""

    family = TENSORWISE
    stateful = True

    def scale_blocks(self, recipe: DelayedScaling, role: str) -> Blocks:
        return PER_TENSOR_BLOCKS

    def sharded_plan(
        self,
        frame: AutocastFrame,
        module_state: dict[Any, Any],
        device: torch.device,
        splits: dict[str, int],
        group: Any,
    ) -> DelayedPlan:
        """Each shard records its own amaxes; only the step's reduction over the
        autocast's group makes them the whole tensors', so the group is required."""
        if frame.group is None:
            raise ValueError(
                "DelayedScaling on a tensor-parallel layer needs "
                "fc.autocast(amax_reduction_group=...) containing the tensor-parallel group, "
                "so that every shard's amax reaches the one history all ranks scale from"
            )
        return self.plan(frame, module_state, device)

    def weight_format(self, recipe: DelayedScaling) -> str:
        return recipe.fp8_format.fwd

    def state_weight_quantizer(
        self, recipe: DelayedScaling, module_state: dict[Any, Any]
    ) -> FixedScaleQuantizer:
        scale = module_state[FORWARD].scale_views[1].clone()
        return FixedScaleQuantizer(scale, recipe.fp8_format.fwd)

    def traced_quantizers(
        self,
        recipe: DelayedScaling,
        module_state: dict[Any, Any],
        read: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[DelayedScalingQuantizer, ...]:
        fwd, bwd = module_state[FORWARD], module_state[BACKWARD]
        fmt = recipe.fp8_format
        return (
            DelayedScalingQuantizer(fwd, 0, fmt.fwd, read),
            DelayedScalingQuantizer(fwd, 1, fmt.fwd, read),
            DelayedScalingQuantizer(bwd, 0, fmt.bwd, read),
        )

    def quantizer(self, recipe: DelayedScaling, role: str, group: Any = None) -> Quantizer:
        raise ValueError(
            "DelayedScaling is stateful (its scales come from an amax history): quantize "
            "through fc.Linear under fc.autocast, or use Float8CurrentScaling"
        )

    def grouped_quantizers(self, recipe: DelayedScaling) -> tuple[Quantizer, ...]:
        """Per-tensor current scaling per token group and per expert, in the recipe's
        formats and margin: the experts keep no amax history (one per token group would
        describe groups whose sizes change every step)."""
        fmt = recipe.fp8_format
        return tuple(
            CurrentScalingQuantizer(fmt=fmt.for_role(role), margin=recipe.margin) for role in ROLES
        )

    def prepare(
        self, recipe: DelayedScaling, module_state: dict[Any, Any], device: torch.device
    ) -> None:
        """Give the module fresh metas (amaxes 0, scales 1) for the directions it has none
        of; the ones it has are fitted to the recipe when they join a slab."""
        for direction, n, elem in _directions(recipe):
            if direction not in module_state:
                origin = ScalingOrigin.of(recipe, elem)
                module_state[direction] = ScalingMeta(n, recipe.amax_history_len, device, origin)

    def plan(
        self, frame: AutocastFrame, module_state: dict[Any, Any], device: torch.device
    ) -> DelayedPlan:
        """Attach the module's metas (``module_state``: direction -> ScalingMeta, made
        here on first use) to the current owner's slabs for the frame's key."""
        recipe = frame.recipe
        state = DelayedState.of(thread_state())
        key = frame.key()
        # Checked and claimed under one lock: two owners that find the module free at
        # the same moment cannot both take it.
        with claims:
            for meta in module_state.values():
                refuse_concurrent_use(meta, state)
            self.prepare(recipe, module_state, device)
            slabs, metas = [], []
            for direction, _, elem in _directions(recipe):
                meta = module_state[direction]
                if meta.history.device != device:
                    meta.move_to(device)
                slab = state.slab(key, frame.group, direction, elem, device)
                if meta.slab is not slab:
                    slab.add(meta)
                slabs.append(slab)
                metas.append(meta)
        return DelayedPlan(recipe, frame.group, state, tuple(slabs), tuple(metas))

    def join_compiled(
        self, frame: AutocastFrame, module_state: dict[Any, Any], params: list[torch.Tensor]
    ) -> None:
        """Eager set-up for compiled code that records into a module's metas (see
        ``fastcast.compile``): attach them to this thread's slabs as ``plan`` does, have
        every update include those slabs, and have the backward pass end the step through
        a hook on the first of ``params`` (the module's) that requires grad.

        A module with none (frozen) has no leaf to hook: refused when grad is enabled,
        since its backward (a gradient for its input) would record amaxes that no hook
        reliably turns into an update.
        """
        watched = next((p for p in params if p.requires_grad), None)
        if watched is None and torch.is_grad_enabled():  # refused before anything changes
            raise RuntimeError(
                "fastcast: DelayedScaling under torch.compile needs each fc.Linear to have "
                "a weight or bias that requires grad (their gradient starts its backward "
                "scale update); run frozen layers under torch.no_grad, or use "
                "Float8CurrentScaling"
            )
        plan = self.plan(frame, module_state, params[0].device)
        plan.state.compiled.update((plan.fwd_slab, plan.bwd_slab))
        if watched is not None:
            plan.state.watch_backward(watched)


def _directions(recipe: DelayedScaling) -> tuple[tuple[int, int, str], ...]:
    """``(direction, columns, element format)``: forward scales the input and weight,
    backward the output gradient."""
    fmt = recipe.fp8_format
    return ((FORWARD, 2, fmt.fwd), (BACKWARD, 1, fmt.bwd))
