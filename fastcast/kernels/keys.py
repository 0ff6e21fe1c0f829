"""The keys of a build: ``build_key`` digests everything that changes the library (the
sources, the compiler's resolved path and ``--version``, the flags, include paths, the
Python ABI, torch's version and location) into the build directory's name, so that two
environments share a directory exactly when they would build the same library;
``abi_key`` is what an installed library must match to be loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from . import sources

# The constants are read from ``sources`` at each call, not bound here: a key describes
# what the build would read now.


def _digest(files: tuple[Path, ...]) -> str:
    digest = hashlib.sha256()
    for source in files:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def _python_abi() -> str:
    return f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}"


def abi_key() -> dict[str, str]:
    """What a finished library must have been built for to be loaded here: the sources,
    the flags, the Python ABI and the torch build (its version, its commit and C++ ABI;
    not its location, so that a wheel built against this torch elsewhere loads). The
    library installed with the package is loaded only when its key equals this one.
    Cheap (no compiler, no ``cpp_extension`` import). Raises ``OSError`` when a source
    file is missing (an incomplete install)."""
    return {
        "sources": _digest((*sources.SOURCES, *sources.HEADERS)),
        "cflags": " ".join(sources.CFLAGS),
        "ldflags": " ".join(sources.LDFLAGS),
        "python": _python_abi(),
        "torch": torch.__version__,
        "torch_commit": str(torch.version.git_version),
        "cxx11_abi": str(torch._C._GLIBCXX_USE_CXX11_ABI),
    }


def build_key() -> dict[str, str]:
    """Everything that changes the library: what the build directory's name digests.

    The compiler is the one ``cpp_extension`` runs (``$CXX``, default ``c++``), by
    resolved path and ``--version``; torch by version and location (the library links
    against that install's libraries and ABI). Raises ``OSError`` when a source file is
    missing (an incomplete install)."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, first use only

    compiler = cpp_extension.get_cxx_compiler()
    found = shutil.which(compiler)
    return {
        "sources": _digest((*sources.SOURCES, *sources.HEADERS)),
        "compiler": os.path.realpath(found) if found else f"{compiler} (not found)",
        "compiler_version": _compiler_version(found),
        "cflags": " ".join(sources.CFLAGS),
        "ldflags": " ".join(sources.LDFLAGS),
        "include_paths": os.pathsep.join(
            [*cpp_extension.include_paths(), sysconfig.get_path("include") or ""]
        ),
        "python": _python_abi(),
        "torch": torch.__version__,
        "torch_path": str(Path(torch.__file__).resolve().parent),
        "cxx11_abi": str(torch._C._GLIBCXX_USE_CXX11_ABI),
    }


def _compiler_version(path: str | None, marker: str = "") -> str:
    """The first line of ``path --version`` that holds ``marker`` (nvcc's first line names
    only the tool: its release line is asked for), empty when it does not answer."""
    if path is None:
        return ""
    try:
        done = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({type(exc).__name__})"
    lines = [line.strip() for line in done.stdout.strip().splitlines() if marker in line]
    return lines[0] if lines else f"(exit status {done.returncode})"


def build_root() -> Path:
    """The folder that holds the build directories (``FASTCAST_KERNELS_DIR``)."""
    return Path(os.environ.get("FASTCAST_KERNELS_DIR") or Path.home() / ".cache/fastcast/kernels")


def build_dir(key: dict[str, str] | None = None) -> Path:
    """Where the library of this key (default: ``build_key()``) is built."""
    key = build_key() if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return build_root() / digest[:16]


def cuda_torch() -> bool:
    """Whether this torch can run CUDA kernels here: built with CUDA (a CPU wheel is not,
    whatever ``torch.cuda`` is made to answer) and a GPU present."""
    return torch.backends.cuda.is_built() and torch.cuda.is_available()


def nvcc() -> str | None:
    """The nvcc ``cpp_extension`` would run (``$CUDA_HOME/bin/nvcc``), or None."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, first use only

    home = cpp_extension.CUDA_HOME
    if home is None:
        return None
    path = Path(home) / "bin" / "nvcc"
    return str(path) if path.exists() else None


def cuda_build_key() -> dict[str, str]:
    """``build_key()`` for the CUDA library: its sources, nvcc (path and version), the
    GPU architectures it is built for, and the CPU library's key (the host compiler,
    Python and torch)."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, first use only

    compiler = nvcc()
    return {
        **build_key(),
        "cuda_sources": _digest((*sources.CUDA_SOURCES, *sources.CUDA_HEADERS)),
        "nvcc": compiler or "(not found)",
        "nvcc_version": _compiler_version(compiler, "release"),
        "nvcc_flags": " ".join(sources.NVCC_FLAGS),
        # TORCH_CUDA_ARCH_LIST, else the visible GPUs: what the kernels are compiled for.
        "cuda_arch": " ".join(cpp_extension._get_cuda_arch_flags()),
        "torch_cuda": str(torch.version.cuda),
    }
