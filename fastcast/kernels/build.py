"""Builds and loads the C++ operators (``csrc/``) on first use, once per process.

The library is compiled by ``torch.utils.cpp_extension.load`` (g++ and ninja, about
30 s on two cores) into a build directory keyed by the source, the flags and the torch
version, so a later process only loads it. ``FASTCAST_KERNELS_DIR`` moves that directory
(default: ``~/.cache/fastcast/kernels``). A failed build (no compiler, no ninja) warns
once and leaves the reference path in charge; nothing is compiled at import.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "tensorwise.cpp",
        "blocks.cpp",
        "rows.cpp",
        "nvfp4.cpp",
        "gemm.cpp",
        "dequantize.cpp",
        "bindings.cpp",
    )
)
# Included by the sources: part of what the build directory is keyed by.
HEADERS = (CSRC / "fp8.h",)
# The operators the library defines (each source file its own, TORCH_LIBRARY_FRAGMENT
# beside the one TORCH_LIBRARY); ``choice.fused_op`` hands out their Python entry points
# (bindings.cpp) by name.
OPS = (
    "quantize_tensorwise",
    "record_amax",
    "quantize_recording",
    "quantize_blocks",
    "quantize_rows",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "scaled_mm_tensorwise",
    "dequantize_blocks",
    "dequantize_nvfp4",
)
# -O3 vectorises the amax and cast loops (the other two let it if-convert float
# comparisons; neither changes a value). No -march=native: a shared build directory
# must not hold code that faults on an older CPU.
CFLAGS = ("-O3", "-fno-trapping-math", "-fno-math-errno", "-fopenmp")
# at::parallel_for splits work over torch's OpenMP threads only when built with OpenMP;
# the library then shares the libgomp that torch has already loaded (same soname).
LDFLAGS = ("-fopenmp",)
NAMESPACE = "fastcast_kernels"


logger = logging.getLogger("fastcast")

# Seconds the successful load took, and the loaded module. Process facts: the library is
# loaded at most once per process (a second load would register its operators twice),
# under a lock, since two threads may quantize for the first time together.
_loaded_seconds: float | None = None
_module: ModuleType | None = None
_load_lock = threading.Lock()


class BuildError(RuntimeError):
    """The C++ operators could not be built or loaded."""


def build_dir() -> Path:
    """Where this source, these flags and this torch build their library."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    root = os.environ.get("FASTCAST_KERNELS_DIR") or Path.home() / ".cache/fastcast/kernels"
    return Path(root) / digest.hexdigest()[:16]


def load() -> float:
    """Build (if needed) and load the library; returns the seconds it took.

    Raises ``BuildError`` with the compiler's message when it cannot.
    """
    global _loaded_seconds, _module
    with _load_lock:
        if _loaded_seconds is not None:
            return _loaded_seconds
        from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, first use only

        start = time.perf_counter()
        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        try:
            with _ninja_on_path():
                module = cpp_extension.load(
                    name=NAMESPACE,
                    sources=[str(s) for s in SOURCES],
                    extra_cflags=list(CFLAGS),
                    extra_ldflags=list(LDFLAGS),
                    build_directory=str(directory),
                    is_python_module=True,
                    verbose=False,
                )
        except Exception as exc:  # a missing compiler, ninja, or headers: "no kernels"
            raise BuildError(f"{type(exc).__name__}: {exc}") from exc
        _module = module
        _loaded_seconds = time.perf_counter() - start
    # First use builds (about 30 s on two cores); later processes load the cached build.
    logger.info("fused quantize kernels ready in %.1f s (%s)", _loaded_seconds, directory)
    return _loaded_seconds


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """``cpp_extension`` runs ``ninja`` from PATH. The ``ninja`` wheel (a dependency)
    puts it in the environment's bin directory, which is not on PATH when the
    environment's Python is run without activating it: add that directory for the build."""
    bin_dir = None
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja  # noqa: PLC0415 - only to locate the executable

            bin_dir = ninja.BIN_DIR
    if bin_dir is None:
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join((bin_dir, path)) if path else bin_dir
    try:
        yield
    finally:
        os.environ["PATH"] = path


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
