"""Which quantize implementation runs: the fused C++ operators or the PyTorch reference.

``FASTCAST_KERNELS`` (``auto`` | ``fused`` | ``reference``), read once (see ``refresh``):

- ``auto`` (default): the fused operators where they cover the input (CPU tensors) and
  could be built; the reference otherwise, after one warning if the build failed.
- ``fused``: as ``auto``, but a failed build is an error rather than a warning.
- ``reference``: the PyTorch reference everywhere.

The library is built on the first quantize that could use it, never at import. Under
``torch.compile`` the reference is what gets traced (``fastcast.dynamo`` replaces
``tensorwise_op`` there), so Inductor fuses it with its neighbours.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import build

MODES = ("auto", "fused", "reference")

_UNSET: Any = object()
# The per-tensor operator once resolved: the op, or None where the reference runs.
_tensorwise: Any = _UNSET
# Seconds the first load took (build included), None until then or without the library.
build_seconds: float | None = None


def kernels_mode() -> str:
    """The ``FASTCAST_KERNELS`` setting, validated."""
    mode = os.environ.get("FASTCAST_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"FASTCAST_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


def tensorwise_op(x: torch.Tensor) -> Any:
    """The fused per-tensor quantize operator for ``x``, or None: the reference runs."""
    op = _tensorwise
    if op is _UNSET:
        op = _resolve()
    return op if op is not None and x.is_cpu else None


def refresh() -> None:
    """Choose again on the next quantize (after changing ``FASTCAST_KERNELS``)."""
    global _tensorwise
    _tensorwise = _UNSET


def _resolve() -> Any:
    global _tensorwise, build_seconds
    mode = kernels_mode()
    op = None
    if mode != "reference":
        try:
            seconds = build.load()
        except build.BuildError as exc:
            if mode == "fused":
                raise RuntimeError(
                    f"fastcast: FASTCAST_KERNELS=fused but the kernels do not build: {exc}"
                ) from exc
            build.warn_unavailable(str(exc))
        else:
            if build_seconds is None:
                build_seconds = seconds
            from . import fake  # noqa: F401, PLC0415 - needs the library's schemas

            op = torch.ops.fastcast_kernels.quantize_tensorwise.default
    _tensorwise = op
    return op
