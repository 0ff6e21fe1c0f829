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

How a region is found is torch's business: ``torch_checkpoint`` is the one adapter that
reads torch internals for it; a recomputation that cannot be matched raises a clear error
instead of running in another precision (see ``tests/nn/test_linear.py``).
"""

from __future__ import annotations

from typing import Any

from ..runtime.state import OUTSIDE, AutocastFrame
from .torch_checkpoint import current_graph_task_id, region

_LOG_ATTR = "_fastcast_recompute_log"


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
        cursors = self.cursors.setdefault(current_graph_task_id(), {})
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


def checkpoint_region(active: bool) -> tuple[RecomputeLog, bool] | None:
    """``(log, recomputing)`` when the calling module runs inside a checkpointed region,
    else None. ``active``: whether the module's frame quantizes or records (only those
    calls are recorded, so only they pay for finding a reentrant region's original
    forward, which means reading the Python stack)."""
    found = region(active)
    if found is None or found[0] is None:
        return None
    owner, recomputing = found
    log = getattr(owner, _LOG_ATTR, None)
    if log is None:
        if recomputing:  # the original forward recorded nothing: all high precision
            return None
        log = RecomputeLog()
        setattr(owner, _LOG_ATTR, log)
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
