"""Which quantize implementation runs: the fused C++ operators or the PyTorch reference.

``FASTCAST_KERNELS`` (``auto`` | ``fused`` | ``reference``), read once (see ``refresh``):

- ``auto`` (default): the fused operators where they cover the input (CPU tensors) and
  could be built; the reference otherwise, after one warning if the build failed.
- ``fused``: as ``auto``, but a failed build is an error rather than a warning.
- ``reference``: the PyTorch reference everywhere.

The library is built on the first quantize that could use it, never at import. Under
``torch.compile`` the reference is what gets traced (``fastcast.dynamo`` replaces
``fused_op`` there), so Inductor fuses it with its neighbours.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import build

MODES = ("auto", "fused", "reference")

# The fused operators by name once resolved ({} where the reference runs), or None
# before the first quantize that could use them. A process fact, like the library.
_ops: dict[str, Any] | None = None


def kernels_mode() -> str:
    """The ``FASTCAST_KERNELS`` setting, validated."""
    mode = os.environ.get("FASTCAST_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"FASTCAST_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


def fused_op(name: str, x: torch.Tensor) -> Any:
    """The fused operator ``name`` (one of ``build.OPS``) for ``x``, or None: the
    reference runs."""
    ops = _ops
    if ops is None:
        ops = _resolve()
    return ops.get(name) if x.is_cpu else None


def tensorwise_op(x: torch.Tensor) -> Any:
    """The fused per-tensor quantize operator for ``x``, or None."""
    return fused_op("quantize_tensorwise", x)


def registered_op(name: str) -> Any:
    """The registered operator ``torch.ops.fastcast_kernels.<name>.default`` (what
    ``fused_op``'s entry points call), for ``torch.library.opcheck`` and for code that
    needs an ``OpOverload``; loads the library first."""
    build.load()
    return getattr(getattr(torch.ops, build.NAMESPACE), name).default


def refresh() -> None:
    """Choose again on the next quantize (after changing ``FASTCAST_KERNELS``)."""
    global _ops
    _ops = None


def _resolve() -> dict[str, Any]:
    global _ops
    mode = kernels_mode()
    ops: dict[str, Any] = {}
    if mode != "reference":
        try:
            entry_points = build.entry_points()
        except build.BuildError as exc:
            if mode == "fused":
                raise RuntimeError(
                    f"fastcast: FASTCAST_KERNELS=fused but the kernels do not build: {exc}"
                ) from exc
            build.warn_unavailable(str(exc))
        else:
            from . import fake  # noqa: F401, PLC0415 - needs the library's schemas

            ops = entry_points
    _ops = ops
    return ops
