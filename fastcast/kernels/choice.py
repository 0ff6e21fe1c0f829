"""Which quantize implementation runs: fused C++ operators on the CPU, native CUDA
kernels or Inductor-compiled operators on CUDA, or the PyTorch reference.

``FASTCAST_KERNELS`` (``auto`` | ``fused`` | ``compiled`` | ``reference``), read once per
device kind (see ``refresh``):

- ``auto`` (default): CPU tensors get the C++ operators (``build``); CUDA tensors the
  native CUDA kernels of the same operators (``build.load_cuda``: where torch has CUDA,
  a GPU is present and nvcc is found), and for an operator without one (or when they do
  not build, after one warning) the reference math compiled by Inductor into Triton
  kernels (``compiled``). Where neither is to be had (the build fails; Triton is
  missing) the reference runs, after one warning.
- ``fused``: as ``auto``, but an operator with no fused implementation is an error, not
  a warning.
- ``compiled``: the Inductor-compiled operators on every device (CPU included): on a
  GPU, the way to compare them with the native kernels.
- ``reference``: the PyTorch reference everywhere.

Other devices always run the reference. Nothing is built or compiled at import: the C++
library on the first CPU quantize that could use it, the CUDA library on the first CUDA
quantize, each compiled operator at its first call. Under ``torch.compile`` the
reference is what gets traced (``fastcast.compile`` replaces ``fused_op`` there), so
Inductor fuses it with its neighbours and no compiled operator is nested in the user's
graph.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any

import torch

from . import build

MODES = ("auto", "fused", "compiled", "reference")
TRITON_CAPABILITY = (7, 0)  # the oldest GPUs Triton compiles for

# The operators by name for CPU and for CUDA tensors once resolved ({} where the
# reference runs), or None before the first quantize that could use them: a pure memo of
# fixed facts (FASTCAST_KERNELS, the machine, the build), forgotten by refresh(). Kept
# here, not in the state manager: runtime imports kernels, so kernels may not import it.
_cpu_ops: dict[str, Any] | None = None
_cuda_ops: dict[str, Any] | None = None


def kernels_mode() -> str:
    """The ``FASTCAST_KERNELS`` setting, validated."""
    mode = os.environ.get("FASTCAST_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"FASTCAST_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


def fused_op(name: str, x: torch.Tensor) -> Any:
    """The fused operator ``name`` (one of ``build.OPS``) for ``x``, or None: the
    reference runs."""
    if x.is_cpu:
        ops = _cpu_ops
        if ops is None:
            ops = _resolve_cpu()
    elif x.is_cuda:
        ops = _cuda_ops
        if ops is None:
            ops = _resolve_cuda()
    else:
        return None
    return ops.get(name)


def tensorwise_op(x: torch.Tensor) -> Any:
    """The fused per-tensor quantize operator for ``x``, or None."""
    return fused_op("quantize_tensorwise", x)


def registered_op(name: str) -> Any:
    """The registered operator ``torch.ops.fastcast_kernels.<name>.default`` (what
    ``fused_op``'s CPU entry points call), for ``torch.library.opcheck`` and for code
    that needs an ``OpOverload``; loads the library first."""
    build.load()
    return getattr(getattr(torch.ops, build.NAMESPACE), name).default


def refresh() -> None:
    """Choose again on the next quantize (after changing ``FASTCAST_KERNELS``). Part of
    ``fastcast.runtime.hardware.refresh()``, which forgets every environment-derived answer
    (this module sits below ``hardware`` and cannot call it)."""
    global _cpu_ops, _cuda_ops
    _cpu_ops = _cuda_ops = None


def _resolve_cpu() -> dict[str, Any]:
    global _cpu_ops
    mode = kernels_mode()
    if mode == "compiled":
        ops = _compiled_ops()
    elif mode == "reference":
        ops = {}
    else:
        ops = _cpp_ops(required=mode == "fused")
    _cpu_ops = ops
    return ops


def _resolve_cuda() -> dict[str, Any]:
    global _cuda_ops
    mode = kernels_mode()
    ops: dict[str, Any] = {}
    if mode != "reference":
        # Native kernels where built (``compiled`` forces Inductor, so that a GPU run can
        # compare the two); Inductor's compiled operators for every op without one.
        native = _native_cuda_ops() if mode != "compiled" else {}
        compiled: dict[str, Any] = {}
        reason = _triton_missing()
        if reason is None:
            compiled = _compiled_ops()
        elif mode == "compiled" or (mode == "fused" and set(native) != set(build.OPS)):
            raise RuntimeError(f"fastcast: FASTCAST_KERNELS={mode} but {reason}")
        else:
            warnings.warn(
                f"fastcast: the compiled CUDA quantize kernels are unavailable ({reason}), "
                "so the (slower) PyTorch reference path runs instead"
                + (" for the operators without a native CUDA kernel" if native else ""),
                RuntimeWarning,
                stacklevel=4,
            )
        ops = {**compiled, **native}
    _cuda_ops = ops
    return ops


def _native_cuda_ops() -> dict[str, Any]:
    """The entry points of the operators with a native CUDA kernel (``build.load_cuda``:
    the same entry points as on the CPU, which the dispatcher routes by device), or {}:
    silently where torch has no CUDA build or no GPU (a CPU install, simulated CUDA),
    after one warning where the kernels do not build (no nvcc, a compile error)."""
    if not build.cuda_torch():
        return {}
    try:
        build.load_cuda()
        entry_points = build.entry_points()
    except build.BuildError as exc:
        build.warn_cuda_unavailable(str(exc))
        return {}
    from . import fake  # noqa: F401, PLC0415 - needs the library's schemas

    return {name: entry_points[name] for name in build.cuda_ops()}


def _cpp_ops(required: bool) -> dict[str, Any]:
    try:
        entry_points = build.entry_points()
    except build.BuildError as exc:
        if required:
            raise RuntimeError(
                f"fastcast: FASTCAST_KERNELS=fused but the kernels do not build: {exc}"
            ) from exc
        build.warn_unavailable(str(exc))
        return {}
    from . import fake  # noqa: F401, PLC0415 - needs the library's schemas

    return entry_points


def _compiled_ops() -> dict[str, Any]:
    from . import inductor  # noqa: PLC0415 - only where a device runs compiled operators

    return inductor.ops()


def _triton_missing() -> str | None:
    """Why Inductor cannot emit Triton kernels for this machine's GPUs, or None."""
    # Whether the package is there, without importing it (that takes seconds): a broken
    # install fails at the first compile instead, with Inductor's message.
    if importlib.util.find_spec("triton") is None:
        return "Inductor needs Triton to compile for CUDA, and triton is not importable"
    capability = torch.cuda.get_device_capability()
    if capability < TRITON_CAPABILITY:
        return f"Triton needs a GPU of compute capability 7.0 or newer, this one is {capability}"
    return None
