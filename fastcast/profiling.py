"""NVTX ranges for nsys traces, decided once at import and free when off.

``FASTCAST_NVTX=1`` in the environment wraps a handful of functions (Linear forward and
backward, quantizers, the scaled GEMM, the amax update) in NVTX ranges of the domain
``fastcast``. Without it ``annotate`` returns the function itself, so a disabled range
costs nothing at all: there is no flag to test per call.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

NVTX_ENABLED = os.environ.get("FASTCAST_NVTX", "0").strip() not in ("", "0", "false", "False")
DOMAIN = "fastcast"


def annotate(name: str) -> Callable[[F], F]:
    """Decorator: run the function inside the NVTX range ``name`` when NVTX is on."""

    def wrap(fn: F) -> F:
        if not NVTX_ENABLED:
            return fn
        import nvtx  # noqa: PLC0415 - only imported when tracing

        domain = nvtx.get_domain(DOMAIN)
        attributes = domain.get_event_attributes(message=name)

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            domain.push_range(attributes)
            try:
                return fn(*args, **kwargs)
            finally:
                domain.pop_range()

        return traced  # type: ignore[return-value]

    return wrap
