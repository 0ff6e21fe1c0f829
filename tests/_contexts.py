"""``isolated(fn, *args)``: ``fn(*args)`` in a fresh ``contextvars.Context``.

It starts from an empty autocast stack and leaves nothing behind in the caller's
context. Delayed-scaling slabs are per thread, so a fresh context still shares them with
other tests in this thread; a slab update moves only the columns of modules that ran, so
those never change what a test observes.
"""

from __future__ import annotations

import contextvars
from typing import Any


def isolated(fn: Any, *args: Any) -> Any:
    return contextvars.Context().run(fn, *args)
