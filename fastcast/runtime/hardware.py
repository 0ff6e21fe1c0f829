"""What this machine can run, computed once per process.

The GEMM backend for each scaling family is one of:

- ``hardware``: ``torch._scaled_mm`` (CUDA FP8 tensor cores, or PyTorch's CPU kernel),
- ``emulate``: dequantize to FP32 and matmul, exact to FP32 rounding, on any device.

``FASTCAST_GEMM`` (``auto`` | ``hardware`` | ``emulate``) overrides the choice. Under
``auto`` the CPU emulates what it has no kernel for, and per-row scaling (its kernel is
slower than the emulation); a CUDA device must have FP8 tensor
cores (compute capability 8.9+); it runs 1x128/128x128 block scaling on sm90's kernels
and MXFP8 / NVFP4 on sm100's (``cuda_block_families``), and emulates, with a warning,
the block-scaled families the GPU (or the installed torch) has no kernel for.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import torch

from ..kernels import choice as _kernel_choice
from ..tensor import BLOCKWISE, MXFP8, NVFP4, ROWWISE, TENSORWISE

GEMM_MODES = ("auto", "hardware", "emulate")

# Lowest CUDA compute capability with FP8 tensor cores.
CUDA_FP8_CAPABILITY = (8, 9)
# Families fastcast drives torch._scaled_mm for, on CPU and on CUDA (8.9+); the
# block-scaled ones that also have a kernel on the GPU are ``cuda_block_families``.
_KERNEL_FAMILIES = (TENSORWISE, ROWWISE)
# Families the CPU emulates under ``auto`` although torch._scaled_mm takes them there:
# its per-row path is 2.4x slower than dequantize + matmul (256x512 @ 512x128, one
# thread; 76 against 48 ms a step for ``python -m bench.train_step --recipes rowwise``).
_CPU_EMULATES = (ROWWISE,)


@functools.cache
def gemm_mode() -> str:
    """The ``FASTCAST_GEMM`` setting, validated; read once (see ``refresh``)."""
    mode = os.environ.get("FASTCAST_GEMM", "auto").strip().lower() or "auto"
    if mode not in GEMM_MODES:
        raise ValueError(f"FASTCAST_GEMM must be one of {GEMM_MODES}, got {mode!r}")
    return mode


@functools.cache
def cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def has_kernel(device_type: str, family: str) -> bool:
    """Whether torch has a scaled GEMM kernel for this family on this device type."""
    if device_type == "cpu":
        return family in _KERNEL_FAMILIES
    if device_type == "cuda":
        cap = cuda_capability()
        if cap is None or cap < CUDA_FP8_CAPABILITY:
            return False
        return family in _KERNEL_FAMILIES or family in cuda_block_families()
    return False


def _cuda_version() -> tuple[int, ...]:
    return tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])


@functools.cache
def cuda_block_families() -> tuple[str, ...]:
    """The block-scaled families whose GEMM torch runs on this GPU, all through
    ``torch.nn.functional.scaled_mm`` (torch 2.10+; ``aten/src/ATen/native/cuda/
    ScaledBlas.cpp``): 1x128/128x128 tiles on sm90 over cuBLASLt 12.9+; MXFP8 (E8M0
    scales) and NVFP4 (E4M3 block scales and an FP32 tensor scale) on sm100 (compute
    capability 10.x) over cuBLASLt 12.8+, with swizzled scales (``gemm_microscaled``)."""
    cap = cuda_capability()
    if cap is None:
        return ()
    if cap[0] == 9 and _cuda_version() >= (12, 9) and block_gemm_missing(BLOCKWISE) is None:
        return (BLOCKWISE,)
    if cap[0] == 10 and _cuda_version() >= (12, 8) and block_gemm_missing(MXFP8) is None:
        return (MXFP8, NVFP4)
    return ()


def block_gemm_missing(family: str) -> str | None:
    """Why the installed torch cannot drive ``family``'s block-scaled GEMM, or None: it
    needs ``torch.nn.functional.scaled_mm`` (torch 2.10+), and for MXFP8 / NVFP4 its
    swizzled scale layout (``SwizzleType.SWIZZLE_32_4_4``)."""
    functional = torch.nn.functional
    if not hasattr(functional, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (2.10+)"
    swizzle = getattr(functional, "SwizzleType", None)
    if family in (MXFP8, NVFP4) and not hasattr(swizzle, "SWIZZLE_32_4_4"):
        return f"torch {torch.__version__}'s F.scaled_mm takes no swizzled scales"
    return None


def cuda_block_output(dtype: torch.dtype) -> bool:
    """Whether the 1x128/128x128 kernel writes ``dtype``: bfloat16 (cuBLASLt's
    block-scaled FP8 GEMMs write 16-bit outputs); other products are emulated rather
    than rounded through bfloat16."""
    return dtype == torch.bfloat16


@functools.cache
def cuda_rowwise_output(dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` writes a per-row scaled FP8 product in ``dtype`` on
    this CUDA device. CUTLASS's row-wise kernel (sm89, sm90, sm100), which torch runs
    unless cuBLAS can, writes bfloat16 only; cuBLAS 12.9+ on sm90 writes any float
    (``aten/src/ATen/native/cuda/ScaledBlas.cpp``). Other products are emulated."""
    cap = cuda_capability()
    if cap is None or cap < CUDA_FP8_CAPABILITY:
        return False
    if dtype == torch.bfloat16:
        return True
    return cap[0] == 9 and _cuda_version() >= (12, 9)


@functools.cache
def _backend(device_type: str, family: str, mode: str) -> tuple[str | None, str]:
    if mode == "emulate":
        return "emulate", "emulated (FASTCAST_GEMM=emulate)"
    if has_kernel(device_type, family):
        if mode == "auto" and device_type == "cpu" and family in _CPU_EMULATES:
            return "emulate", "emulated on cpu (faster than torch._scaled_mm's CPU kernel)"
        return "hardware", f"torch._scaled_mm on {device_type}"
    if mode == "hardware":
        return None, (
            f"{family} scaling has no torch._scaled_mm kernel on {_describe(device_type)} "
            "and FASTCAST_GEMM=hardware forbids emulation"
        )
    if device_type == "cuda":
        cap = cuda_capability()
        if cap is None or cap < CUDA_FP8_CAPABILITY:
            return None, (
                f"FP8 needs a GPU of compute capability 8.9 or newer, this is "
                f"{_describe(device_type)}; set FASTCAST_GEMM=emulate to run it emulated"
            )
        why = "torch has no block-scaled kernel of this family for this GPU"
        missing = block_gemm_missing(family)
        if family in (BLOCKWISE, MXFP8, NVFP4) and missing is not None:
            why = missing
        warnings.warn(
            f"fastcast: {family} GEMMs run emulated (dequantize + matmul) on "
            f"{_describe(device_type)}: {why}",
            RuntimeWarning,
            stacklevel=2,
        )
    return "emulate", f"emulated on {device_type}"


def gemm_backend(device_type: str, family: str) -> tuple[str | None, str]:
    """``(backend, reason)``: backend is ``hardware``, ``emulate`` or None (unsupported)."""
    return _backend(device_type, family, gemm_mode())


def default_device_type() -> str:
    """The device type training runs on by default: CUDA when present, else CPU."""
    return "cuda" if cuda_capability() is not None else "cpu"


def _describe(device_type: str) -> str:
    if device_type == "cuda":
        cap = cuda_capability()
        if cap is None:
            return "a machine without a CUDA device"
        return f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})"
    return device_type.upper()


# Caches elsewhere that depend on the answers here (see ``on_refresh``).
_refresh_hooks: list[Callable[[], None]] = []


def on_refresh(hook: Callable[[], None]) -> Callable[[], None]:
    """Register ``hook`` to run on ``refresh()``; for caches derived from these answers.

    Modules register at import time, so this module needs to import none of them.
    """
    _refresh_hooks.append(hook)
    return hook


def refresh() -> None:
    """Forget every cached answer about this machine and fastcast's environment settings,
    so that a changed ``FASTCAST_GEMM`` or ``FASTCAST_KERNELS`` takes effect: the GEMM
    backends here, the quantize implementations (``kernels.choice``) and the caches
    derived from them (``on_refresh``). The one refresh there is."""
    for fn in (gemm_mode, cuda_capability, cuda_rowwise_output, cuda_block_families, _backend):
        fn.cache_clear()
    _kernel_choice.refresh()
    for hook in _refresh_hooks:
        hook()


def _available(family: str) -> tuple[bool, str]:
    backend, reason = gemm_backend(default_device_type(), family)
    return backend is not None, reason


def fp8_available() -> tuple[bool, str]:
    """Per-tensor FP8 (delayed and current scaling): ``(available, reason)``."""
    return _available(TENSORWISE)


def fp8_rowwise_available() -> tuple[bool, str]:
    """Per-row scaled FP8 (``Float8RowwiseScaling``): ``(available, reason)``."""
    return _available(ROWWISE)


def fp8_block_scaling_available() -> tuple[bool, str]:
    """1x128 / 128x128 block-scaled FP8: ``(available, reason)``."""
    return _available(BLOCKWISE)


def mxfp8_available() -> tuple[bool, str]:
    """MXFP8 (32-element blocks, E8M0 scales): ``(available, reason)``."""
    return _available(MXFP8)


def nvfp4_available() -> tuple[bool, str]:
    """NVFP4 (16-element E2M1 blocks): ``(available, reason)``."""
    return _available(NVFP4)


# CUDA compute capabilities on which torch._scaled_grouped_mm has kernels (sm90, sm100);
# the grouped GEMM drives it for these families, with E4M3 operands.
_GROUPED_CAPABILITIES = ((9, 0), (10, 0))
_GROUPED_KERNEL_FAMILIES = (TENSORWISE, ROWWISE)


@functools.cache
def _grouped_backend(device_type: str, family: str, mode: str) -> tuple[str | None, str]:
    if mode == "emulate":
        return "emulate", "emulated (FASTCAST_GEMM=emulate)"
    cap = cuda_capability() if device_type == "cuda" else None
    kernel = (
        cap in _GROUPED_CAPABILITIES
        and family in _GROUPED_KERNEL_FAMILIES
        and hasattr(torch, "_scaled_grouped_mm")
    )
    if kernel:
        return "hardware", f"torch._scaled_grouped_mm on {_describe(device_type)}"
    if mode == "hardware":
        return None, (
            f"{family} scaling has no torch._scaled_grouped_mm kernel on "
            f"{_describe(device_type)} and FASTCAST_GEMM=hardware forbids emulation"
        )
    return "emulate", f"emulated on {device_type} (quantize, dequantize, torch._grouped_mm)"


def grouped_gemm_backend(device_type: str, family: str) -> tuple[str | None, str]:
    """``(backend, reason)`` of the grouped (mixture-of-experts) GEMM, as ``gemm_backend``
    for the dense one: ``hardware`` is ``torch._scaled_grouped_mm``."""
    return _grouped_backend(device_type, family, gemm_mode())


on_refresh(_grouped_backend.cache_clear)
