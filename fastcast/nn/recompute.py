"""Activation checkpointing: the recomputed forward runs exactly as the original did.

``torch.utils.checkpoint`` (both modes) and everything built on it (Hugging Face's
``gradient_checkpointing_enable()``) run a region's forward once without keeping
activations and again during backward, usually after ``fc.autocast`` has exited and
after delayed-scaling scales have moved on. fastcast needs no argument for that: each
``fc.Linear`` call inside a checkpointed region records the autocast frame it ran under
(and what its scheme needs to replay, e.g. delayed scaling's scales and weight) in a log
attached to the region's own checkpoint object, and the recomputation replays it, call by
call per module. A module that ran in high precision records nothing and is recomputed in
high precision.

How a region is found, without changing torch:

- ``use_reentrant=False``: the region's saved-tensor hooks are on top of the hook stack
  during the original forward (``_checkpoint_hook``, whose closure holds the region's
  frame object) and during the recomputation (``_recomputation_hook``, holding a weak
  reference to the same object);
- ``use_reentrant=True``: the original forward runs under ``no_grad`` inside
  ``CheckpointFunction.forward`` and the recomputation inside
  ``CheckpointFunction.backward``; the ``ctx`` of that frame is the region.

Both are read from torch internals that have been stable since torch 2.1; should they
change, a recomputation that cannot be matched raises a clear error instead of running
in another precision (see ``tests/nn/test_linear.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from ..runtime.state import OUTSIDE, AutocastFrame

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_graph_task_id = torch._C._current_graph_task_id
_LOG_ATTR = "_fastcast_recompute_log"
# How far up the Python stack a reentrant checkpoint's frame is looked for.
_MAX_DEPTH = 64


def _reentrant_codes() -> tuple[Any, Any]:
    from torch.utils.checkpoint import CheckpointFunction  # noqa: PLC0415 - torch internal

    return CheckpointFunction.forward.__code__, CheckpointFunction.backward.__code__


_REENTRANT_FORWARD, _REENTRANT_BACKWARD = _reentrant_codes()


class RecomputeLog:
    """What each module's calls in one checkpointed region ran with, in call order."""

    __slots__ = ("entries", "cursors")

    def __init__(self) -> None:
        self.entries: dict[Any, list[list[Any]]] = {}
        # Per recomputation (graph task): how many entries each module has replayed.
        self.cursors: dict[int, dict[Any, int]] = {}

    def record(self, module: Any, frame: AutocastFrame) -> list[Any]:
        """A new entry ``[frame, scheme data]`` for ``module``; the caller fills the data."""
        entry = [frame, None]
        self.entries.setdefault(module, []).append(entry)
        return entry

    def replay(self, module: Any) -> list[Any] | None:
        """The entry of ``module``'s next call in this recomputation; None when the original
        call recorded nothing (it ran in high precision)."""
        cursors = self.cursors.setdefault(_graph_task_id(), {})
        index = cursors.get(module, 0)
        entries = self.entries.get(module)
        if entries is None:
            return None
        if index >= len(entries):
            raise RuntimeError(
                f"fastcast: activation recomputation ran {type(module).__name__} more times "
                f"({index + 1}) than the original forward ({len(entries)}); the checkpointed "
                "function must run the same fastcast modules on recomputation"
            )
        cursors[module] = index + 1
        return entries[index]


def _closure_var(fn: Callable[..., Any], name: str) -> Any:
    fn = getattr(fn, "__wrapped__", fn)  # torch wraps one hook in a dynamo-disable shim
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars or fn.__closure__ is None:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _non_reentrant_region(pack_hook: Callable[..., Any]) -> tuple[Any, bool] | None:
    name = getattr(pack_hook, "__qualname__", "")
    if name.startswith("_checkpoint_hook."):
        region = _closure_var(pack_hook, "frame")
        return None if region is None else (region, False)
    if name.startswith("_recomputation_hook."):
        ref = _closure_var(pack_hook, "target_frame_ref")
        region = ref() if callable(ref) else None
        return None if region is None else (region, True)
    return None


def _reentrant_region(code: Any) -> Any:
    frame = sys._getframe(2)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals.get("ctx")
        frame = frame.f_back
    return None


def checkpoint_region(active: bool) -> tuple[RecomputeLog, bool] | None:
    """``(log, recomputing)`` when the calling module runs inside a checkpointed region,
    else None. ``active``: whether the module's frame quantizes or records (only those
    calls are recorded, so only they pay for finding a reentrant region's original
    forward, which means reading the Python stack)."""
    hooks = _top_hooks(False)
    if hooks is not None:
        found = _non_reentrant_region(hooks[0])
    elif not torch.is_grad_enabled():
        found = (_reentrant_region(_REENTRANT_FORWARD), False) if active else None
    elif _graph_task_id() != -1:  # a forward inside a backward: maybe a recomputation
        found = (_reentrant_region(_REENTRANT_BACKWARD), True)
    else:
        return None
    if found is None or found[0] is None:
        return None
    region, recomputing = found
    log = getattr(region, _LOG_ATTR, None)
    if log is None:
        if recomputing:  # the original forward recorded nothing: all high precision
            return None
        log = RecomputeLog()
        setattr(region, _LOG_ATTR, log)
    return log, recomputing


def checkpointed_call(
    module: Any, frame: AutocastFrame, log: RecomputeLog, recomputing: bool
) -> tuple[AutocastFrame, list[Any] | None, list[Any] | None]:
    """``(frame, replay, record)`` of ``module``'s call inside a checkpointed region
    (``checkpoint_region``'s ``log, recomputing``): a recomputation runs under the
    original call's frame and replays its entry (a call that recorded nothing ran in high
    precision); an original call that quantizes or records gets an entry to fill."""
    if recomputing:
        entry = log.replay(module)
        return (OUTSIDE, None, None) if entry is None else (entry[0], entry, None)
    return frame, None, (log.record(module, frame) if frame.active else None)
