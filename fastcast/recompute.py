"""Activation recomputation that reproduces the forward exactly.

``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False,
context_fn=fc.checkpoint_context)`` runs ``fn`` once without keeping activations and
again in backward. The second run happens outside the user's ``fc.autocast`` and after
delayed-scaling scales have moved on, so the context pair recorded here re-creates the
autocast state and hands each module the scales its first run used, in order.
"""

from __future__ import annotations

import collections
from typing import Any

from .state import AutocastFrame, thread_state


class ReplayLog:
    """Scales used by the original forward, replayed in the same order."""

    __slots__ = ("recording", "entries", "frame")

    def __init__(self) -> None:
        self.recording = True
        self.entries: collections.deque = collections.deque()
        self.frame: AutocastFrame | None = None

    def push(self, entry: Any) -> None:
        self.entries.append(entry)

    def pop(self) -> Any:
        if not self.entries:
            raise RuntimeError(
                "activation recomputation ran more fastcast modules than the original forward"
            )
        return self.entries.popleft()


class _RecordForward:
    """Around the original forward: note the autocast state and each module's scales."""

    __slots__ = ("log", "_saved")

    def __init__(self, log: ReplayLog) -> None:
        self.log = log

    def __enter__(self) -> None:
        ts = thread_state()
        self.log.frame = ts.frame
        self._saved = ts.replay
        ts.replay = self.log

    def __exit__(self, *exc: Any) -> None:
        thread_state().replay = self._saved
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
        self._saved = (ts.frame, ts.replay)
        ts.frame, ts.replay = frame, self.log

    def __exit__(self, *exc: Any) -> None:
        ts = thread_state()
        ts.frame, ts.replay = self._saved


def checkpoint_context() -> tuple[_RecordForward, _Replay]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``."""
    log = ReplayLog()
    return _RecordForward(log), _Replay(log)
