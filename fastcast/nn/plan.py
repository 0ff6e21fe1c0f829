"""What a Linear needs to run one recipe: its quantizers and delayed-scaling hooks.

A plan is built when a module first meets a (recipe, group) pair in a thread and reused
while the pair stays the same, so the forward pass does two identity tests, not a
recipe-to-quantizer translation.
"""

from __future__ import annotations

from typing import Any

import torch

from ..delayed import BACKWARD, FORWARD, DelayedScalingRegistry, ScalingMeta, Slab
from ..quantize import DelayedScalingQuantizer, Quantizer, stateless_quantizers
from ..recipe import DelayedScaling, Recipe
from ..state import AutocastFrame, ThreadState


class Plan:
    """Quantizers for input, weight and grad_output under one recipe and group."""

    __slots__ = (
        "recipe",
        "group",
        "input_q",
        "weight_q",
        "grad_q",
        "registry",
        "fwd_slab",
        "bwd_slab",
        "fwd_meta",
        "bwd_meta",
    )

    def __init__(self, recipe: Recipe, group: Any) -> None:
        self.recipe = recipe
        self.group = group
        self.registry: DelayedScalingRegistry | None = None
        self.fwd_slab: Slab | None = None
        self.bwd_slab: Slab | None = None
        self.fwd_meta: ScalingMeta | None = None
        self.bwd_meta: ScalingMeta | None = None
        self.input_q: Quantizer
        self.weight_q: Quantizer
        self.grad_q: Quantizer

    @property
    def delayed(self) -> bool:
        return self.registry is not None

    def matches(self, frame: AutocastFrame, ts: ThreadState) -> bool:
        return (
            frame.recipe is self.recipe
            and frame.group is self.group
            and (self.registry is None or self.registry is ts.registry)
        )


def build_plan(
    frame: AutocastFrame, ts: ThreadState, metas: dict[int, ScalingMeta], device: torch.device
) -> Plan:
    """A plan for ``frame``'s recipe; delayed scaling attaches ``metas`` to the slabs."""
    recipe = frame.recipe
    plan = Plan(recipe, frame.group)
    if not isinstance(recipe, DelayedScaling):
        plan.input_q, plan.weight_q, plan.grad_q = stateless_quantizers(recipe, frame.group)
        return plan

    if ts.registry is None:
        ts.registry = DelayedScalingRegistry()
    registry = plan.registry = ts.registry
    key = frame.key()
    fmt = recipe.fp8_format
    for direction, n, elem in ((FORWARD, 2, fmt.fwd), (BACKWARD, 1, fmt.bwd)):
        meta = metas.get(direction)
        if meta is None:
            meta = metas[direction] = ScalingMeta(n, recipe.amax_history_len, device)
        elif meta.history.device != device:
            meta.move_to(device)
        slab = registry.slab(key, frame.group, direction, elem, device)
        if meta.slab is not slab:
            slab.add(meta)
        if direction == FORWARD:
            plan.fwd_slab, plan.fwd_meta = slab, meta
        else:
            plan.bwd_slab, plan.bwd_meta = slab, meta
    plan.input_q = DelayedScalingQuantizer(plan.fwd_meta, 0, fmt.fwd)
    plan.weight_q = DelayedScalingQuantizer(plan.fwd_meta, 1, fmt.fwd)
    plan.grad_q = DelayedScalingQuantizer(plan.bwd_meta, 0, fmt.bwd)
    return plan
