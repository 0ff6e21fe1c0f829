"""Builds and loads the C++ operators (``csrc/``) on first use, once per process.

The library is compiled by ``torch.utils.cpp_extension.load`` (g++ and ninja, about
10 s on two cores) into a build directory keyed by the source, the flags and the torch
version, so a later process only loads it. ``FASTCAST_KERNELS_DIR`` moves that directory
(default: ``~/.cache/fastcast/kernels``). A failed build (no compiler, no ninja) warns
once and leaves the reference path in charge; nothing is compiled at import.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from pathlib import Path

import torch

SOURCES = (Path(__file__).parent / "csrc" / "tensorwise.cpp",)
# -O3 vectorises the amax and cast loops (the other two let it if-convert float
# comparisons; neither changes a value). No -march=native: a shared build directory
# must not hold code that faults on an older CPU.
CFLAGS = ("-O3", "-fno-trapping-math", "-fno-math-errno", "-fopenmp")
# at::parallel_for splits work over torch's OpenMP threads only when built with OpenMP;
# the library then shares the libgomp that torch has already loaded (same soname).
LDFLAGS = ("-fopenmp",)
NAMESPACE = "fastcast_kernels"


# Seconds the successful load took; the library is loaded at most once per process
# (a second load would register its operators twice).
_loaded_seconds: float | None = None


class BuildError(RuntimeError):
    """The C++ operators could not be built or loaded."""


def build_dir() -> Path:
    """Where this source, these flags and this torch build their library."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    root = os.environ.get("FASTCAST_KERNELS_DIR") or Path.home() / ".cache/fastcast/kernels"
    return Path(root) / digest.hexdigest()[:16]


def load() -> float:
    """Build (if needed) and load the library; returns the seconds it took.

    Raises ``BuildError`` with the compiler's message when it cannot.
    """
    global _loaded_seconds
    if _loaded_seconds is not None:
        return _loaded_seconds
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, first use only

    start = time.perf_counter()
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=NAMESPACE,
            sources=[str(s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a missing compiler, ninja, or headers: all mean "no kernels"
        raise BuildError(f"{type(exc).__name__}: {exc}") from exc
    _loaded_seconds = time.perf_counter() - start
    return _loaded_seconds


def warn_unavailable(reason: str) -> None:
    warnings.warn(
        "fastcast: the fused C++ quantize kernels could not be built, so the (slower) "
        f"PyTorch reference path runs instead. Reason: {reason}",
        RuntimeWarning,
        stacklevel=3,
    )
