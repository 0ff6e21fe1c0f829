"""Activation recomputation that reproduces the forward exactly.

``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False,
context_fn=fc.checkpoint_context)`` runs ``fn`` once without keeping activations and
again in backward. The second run happens outside the user's ``fc.autocast`` and after
delayed-scaling scales have moved on, so the context pair recorded here re-creates the
autocast state and has each delayed-scaling module replay the scales (and weight) its
first run used, in order.
"""

from __future__ import annotations

from typing import Any

from .schemes.delayed import DelayedThreadState, ReplayLog
from .state import AutocastFrame, thread_state


class _RecordForward:
    """Around the original forward: note the autocast state and each module's scales."""

    __slots__ = ("log", "_saved")

    def __init__(self, log: ReplayLog) -> None:
        self.log = log

    def __enter__(self) -> None:
        ts = thread_state()
        self.log.frame = ts.frame
        delayed = DelayedThreadState.of(ts)
        self._saved = delayed.replay
        delayed.replay = self.log

    def __exit__(self, *exc: Any) -> None:
        DelayedThreadState.of(thread_state()).replay = self._saved
        self.log.recording = False


class _Replay:
    """Around the recomputation: the original autocast state, replaying the scales.

    The frame is pushed directly rather than through ``fc.autocast``, so leaving it
    updates no scales and ends no step.
    """

    __slots__ = ("log", "_saved")

    def __init__(self, log: ReplayLog) -> None:
        self.log = log

    def __enter__(self) -> None:
        ts = thread_state()
        original = self.log.frame
        frame = AutocastFrame(
            original.enabled, original.recipe, original.calibrating, original.group
        )
        frame._prev = ts.frame
        delayed = DelayedThreadState.of(ts)
        self._saved = (ts.frame, delayed.replay)
        ts.frame, delayed.replay = frame, self.log

    def __exit__(self, *exc: Any) -> None:
        ts = thread_state()
        ts.frame, DelayedThreadState.of(ts).replay = self._saved


def checkpoint_context() -> tuple[_RecordForward, _Replay]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``."""
    log = ReplayLog()
    return _RecordForward(log), _Replay(log)
