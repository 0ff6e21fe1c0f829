"""``DelayedScaling``, all of it: per-tensor FP8 whose scales come from the amax history
of earlier steps.

- ``state``: the per-module state (``ScalingMeta``: amax history and scales per
  direction, with the recipe fields they were made under), the slabs that batch every
  module's columns into one update, and the update itself;
- ``scheme``: the scheme (plans for modules, quantizers refused outside them);
- ``owners``: the per-owner step state (a thread's or an asyncio task's slabs, what
  they have pending) and when the updates run;
- ``plan``: a module's plan and the per-call hooks (``DelayedCall`` under activation
  checkpointing);
- ``saved_state``: how that state is saved in a module's extra state (kind 1 of the
  codec ``fastcast.serialization.extra_state``, which knows it only as a registered
  ``StateFormat``), loaded and validated;
- ``te_state``: TransformerEngine's delayed-scaling extra state, read into ``ScalingMeta``s.

Compiled code reaches it through ``fastcast.compile`` (``compile/delayed.py`` traces
these quantizers into graphs).
"""

from __future__ import annotations

from .owners import DelayedState, DelayedThreadState
from .plan import DelayedCall, DelayedPlan
from .saved_state import DelayedStateFormat
from .scheme import DelayedScalingScheme
from .state import (
    BACKWARD,
    FORWARD,
    UNKNOWN_ORIGIN,
    ScalingMeta,
    ScalingOrigin,
    Slab,
    check_scaling_tensors,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "UNKNOWN_ORIGIN",
    "DelayedCall",
    "DelayedPlan",
    "DelayedScalingScheme",
    "DelayedState",
    "DelayedStateFormat",
    "DelayedThreadState",
    "ScalingMeta",
    "ScalingOrigin",
    "Slab",
    "check_scaling_tensors",
]
