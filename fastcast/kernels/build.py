"""Loads the C++ operators (``csrc/``) once per process: the library installed with the
package when its ``abi_key`` is this process's (``installed``), else the one of this
environment's build directory (``keys.build_dir``), compiled on first use under the
directory's lock (``directory``). Nothing is compiled at import; a failure is a
``BuildError``, on which ``choice`` warns once and keeps the reference path.
docs/kernel-build.md describes the flow and its measurements.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from . import installed
from .directory import BuildError, build_step, compile_in_child, exclusive, import_library, say
from .keys import (
    abi_key,
    build_dir,
    build_key,
    build_root,
    cuda_build_key,
    cuda_torch,
    nvcc,
)
from .sources import (
    BUILT_STAMP,
    CFLAGS,
    CSRC,
    CUDA_HEADERS,
    CUDA_NAME,
    CUDA_SOURCES,
    HEADERS,
    INSTALLED_KEY,
    INSTALLED_LIBRARY,
    LDFLAGS,
    LOCK_FILE,
    NAMESPACE,
    NVCC_FLAGS,
    OPS,
    SOURCE_COPY,
    SOURCES,
)

__all__ = [
    "BUILT_STAMP",
    "CFLAGS",
    "CSRC",
    "CUDA_HEADERS",
    "CUDA_NAME",
    "CUDA_SOURCES",
    "HEADERS",
    "INSTALLED_KEY",
    "INSTALLED_LIBRARY",
    "LDFLAGS",
    "LOCK_FILE",
    "NAMESPACE",
    "NVCC_FLAGS",
    "OPS",
    "SOURCES",
    "SOURCE_COPY",
    "BuildError",
    "abi_key",
    "build_dir",
    "build_key",
    "build_root",
    "cuda_build_key",
    "cuda_ops",
    "cuda_torch",
    "entry_points",
    "library_path",
    "load",
    "load_cuda",
    "nvcc",
    "warn_cuda_unavailable",
    "warn_unavailable",
]

logger = logging.getLogger("fastcast")

# Seconds the successful load took, and the loaded module. Process facts: the library is
# loaded at most once per process (a second load would register its operators twice),
# under a lock, since two threads may quantize for the first time together.
_loaded_seconds: float | None = None
_module: ModuleType | None = None
_load_lock = threading.Lock()


def load() -> float:
    """Build (if needed) and load the library; returns the seconds it took.

    Raises ``BuildError`` with the reason when it cannot (any failure: a missing source
    file, compiler or ninja, a compile error, a library that does not load)."""
    global _loaded_seconds, _module
    with _load_lock:
        if _loaded_seconds is not None:
            return _loaded_seconds
        start = time.perf_counter()
        try:
            module = installed.load(
                INSTALLED_LIBRARY, INSTALLED_KEY, abi_key(), say, import_library
            )
            if module is None:  # none installed, or not for this torch: build or find it
                key = build_key()
                with exclusive(build_dir(key)):
                    module = _build_or_import(build_dir(key), key)
        except BuildError:
            raise
        except Exception as exc:  # an incomplete install, no compiler, ninja or headers
            raise BuildError(f"{type(exc).__name__}: {exc}") from exc
        _module = module
        _loaded_seconds = time.perf_counter() - start
    logger.info("fused quantize kernels ready in %.1f s (%s)", _loaded_seconds, module.__file__)
    return _loaded_seconds


def library_path() -> str | None:
    """The file of the loaded CPU library (None before ``load``)."""
    return None if _module is None else _module.__file__


def _build_or_import(directory: Path, key: dict[str, str]) -> ModuleType:
    """The library of ``directory``: imported when a finished build is there, else built
    (the caller holds the directory's lock)."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, first use only

    library = directory / f"{NAMESPACE}{cpp_extension.LIB_EXT}"
    stamp = directory / BUILT_STAMP
    if stamp.exists() and library.exists():
        try:
            return import_library(library)
        except ImportError as exc:  # a damaged file: build it again
            logger.warning("fastcast: rebuilding the fused kernels (%s)", exc)
            stamp.unlink()
    say(
        "building the fused C++ quantize kernels (first use with this compiler, Python "
        f"and torch; about 100 s on two cores) in {directory}"
    )
    with build_step("fused kernels", directory, key):
        compile_in_child("cpu", directory)
    return import_library(library)


# Seconds the CUDA library took to load, or the BuildError it failed with: a process
# fact like the CPU library's (tried at most once per process; its registrations would
# clash on a second load).
_cuda_loaded: float | BuildError | None = None


def load_cuda() -> float:
    """Build (if needed) and load the CUDA kernels, after the CPU library; returns the
    seconds it took. Raises ``BuildError`` with the reason when it cannot: no CUDA torch
    or GPU, no nvcc, a compile error. Tried once per process; a failure is remembered."""
    global _cuda_loaded
    load()  # the schemas the CUDA kernels register against
    with _load_lock:
        if isinstance(_cuda_loaded, BuildError):
            raise _cuda_loaded
        if _cuda_loaded is not None:
            return _cuda_loaded
        start = time.perf_counter()
        try:
            if not cuda_torch():
                raise BuildError("this torch has no CUDA build or no GPU is visible")
            if nvcc() is None:
                raise BuildError("nvcc is not found (set CUDA_HOME to a CUDA toolkit)")
            key = cuda_build_key()
            directory = build_dir(key)
            with exclusive(directory):
                _build_or_load_cuda(directory, key)
        except BuildError as exc:
            _cuda_loaded = exc
            raise
        except Exception as exc:  # a compile error, a library that does not load
            _cuda_loaded = BuildError(f"{type(exc).__name__}: {exc}")
            raise _cuda_loaded from exc
        _cuda_loaded = time.perf_counter() - start
    logger.info("CUDA quantize kernels ready in %.1f s (%s)", _cuda_loaded, directory)
    return _cuda_loaded


def _build_or_load_cuda(directory: Path, key: dict[str, str]) -> None:
    """``_build_or_import`` for the CUDA library: a plain shared library of operator
    registrations (no Python module), loaded with ``torch.ops.load_library``."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, first use only

    library = directory / f"{CUDA_NAME}{cpp_extension.LIB_EXT}"
    stamp = directory / BUILT_STAMP
    if stamp.exists() and library.exists():
        torch.ops.load_library(str(library))
        return
    say(
        "building the CUDA quantize kernels (first use with this nvcc, torch and GPU; "
        f"about a minute) in {directory}"
    )
    with build_step("CUDA kernels", directory, key):
        compile_in_child("cuda", directory, str(library_path()))
    torch.ops.load_library(str(library))


def cuda_ops() -> tuple[str, ...]:
    """The operators of ``OPS`` that have a CUDA kernel registered (after ``load_cuda``;
    none before): the dispatcher's own answer, so it is what was built."""
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return tuple(name for name in OPS if has_kernel(f"{NAMESPACE}::{name}", "CUDA"))


def warn_cuda_unavailable(reason: str) -> None:
    warnings.warn(
        "fastcast: the native CUDA quantize kernels could not be built, so the "
        f"Inductor-compiled operators run on CUDA instead (more host time per call). "
        f"Reason: {reason}",
        RuntimeWarning,
        stacklevel=4,
    )


def entry_points() -> dict[str, Any]:
    """The operators' Python entry points by name (``bindings.cpp``: the registered
    operators called through the dispatcher, without ``torch.ops``' boxing); loads first."""
    load()
    return {name: getattr(_module, name) for name in OPS}


def warn_unavailable(reason: str) -> None:
    warnings.warn(
        "fastcast: the fused C++ quantize kernels could not be built, so the (slower) "
        f"PyTorch reference path runs instead. Reason: {reason}",
        RuntimeWarning,
        stacklevel=3,
    )
