"""Builds and loads the C++ operators (``csrc/``), once per process.

An install builds the CPU library (``setup.py``: ``pip install .``, ``pip install -e .``,
``pip wheel .``) against the torch of the environment it installs into, and ships it in
``installed/`` with its ``abi_key``; ``load`` imports it without compiling when this
process's torch, Python, sources and flags are the ones it was built for (``installed``).
Otherwise (a different torch, sources edited in a checkout, an install without torch)
the library is compiled on first use by ``torch.utils.cpp_extension`` (g++ and ninja,
about 30-60 s on two cores) into a build directory named by a digest of everything that
changes the build (``build_key``): the source text, the compiler (its resolved path and
``--version``), the flags, the include paths, the Python ABI, and torch's version and
location. Two environments that would build different libraries never share a
directory; two that would build the same one do, and the second only loads it.
``FASTCAST_KERNELS_DIR`` moves the directories (default: ``~/.cache/fastcast/kernels``).

Across processes a file lock (``fcntl.flock`` on ``<directory>/fastcast.lock``) is held
while a process builds or loads: one process builds, the others wait for it and then
load the finished library, which no process relinks once a ``built`` stamp marks it
complete (its key says nothing it was built from can have changed). The sources are
copied into the directory and compiled from there, so that installs at different paths
(an editable checkout, a wheel) run the same build commands and share one build. The
compile runs in a child process (``_child``) given its environment, ninja's directory on
its ``PATH``: nothing here writes ``os.environ``.

A build prints one line to stderr when it starts and one when it ends (with the time
it took), without any logging set-up, since it stalls the first quantize for tens of
seconds; loading a finished build prints nothing. A failed build (no compiler, no
ninja, a missing source file) raises ``BuildError``; ``choice`` then warns once and
leaves the reference path in charge. Nothing is compiled at import.
``python -m fastcast.kernels`` builds ahead of time (``make`` does, before the
tests and benchmarks) and says where the library is.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
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
HEADERS = (CSRC / "fp8.h", CSRC / "element.h")
# The operators the library defines (each source file its own, TORCH_LIBRARY_FRAGMENT
# beside the one TORCH_LIBRARY); ``choice.fused_op`` hands out their Python entry points
# (bindings.cpp) by name.
OPS = (
    "quantize_tensorwise",
    "record_amax",
    "quantize_recording",
    "delayed_update",
    "quantize_blocks",
    "quantize_rows",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "scaled_mm_tensorwise",
    "dequantize_blocks",
    "dequantize_nvfp4",
)
# The CUDA kernels of the same operators (``TORCH_LIBRARY_IMPL(fastcast_kernels, CUDA)``):
# a second library, built only where torch has CUDA, a GPU is present and nvcc is found,
# and loaded after the CPU library (which defines the operators' schemas). The existing
# entry points reach these kernels for CUDA tensors through the dispatcher.
CUDA_SOURCES = tuple(
    CSRC / "cuda" / name
    for name in (
        "tensorwise.cu",
        "delayed.cu",
        "rows.cu",
        "blocks.cu",
        "nvfp4.cu",
        "dequantize.cu",
    )
)
CUDA_HEADERS = (CSRC / "element.h", CSRC / "cuda" / "common.cuh")
CUDA_NAME = "fastcast_kernels_cuda"
# No fused multiply-add: the element arithmetic (element.h) must round as the CPU's does.
# (No product in it feeds an addition today; this keeps it so.)
NVCC_FLAGS = ("-O3", "--fmad=false")
# -O3 vectorises the amax and cast loops (the other two let it if-convert float
# comparisons; neither changes a value). No -march=native: a shared build directory
# must not hold code that faults on an older CPU.
CFLAGS = ("-O3", "-fno-trapping-math", "-fno-math-errno", "-fopenmp")
# at::parallel_for splits work over torch's OpenMP threads only when built with OpenMP;
# the library then shares the libgomp that torch has already loaded (same soname).
LDFLAGS = ("-fopenmp",)
NAMESPACE = "fastcast_kernels"
# Files of a build directory besides ninja's: the cross-process lock, the stamp written
# once the library is complete (it holds the key), and the copied sources.
LOCK_FILE = "fastcast.lock"
BUILT_STAMP = "built"
SOURCE_COPY = "csrc"
# What an install puts in ``fastcast/kernels/installed/`` (``install_into``): the CPU
# library and its key.
INSTALLED_LIBRARY = f"{NAMESPACE}.so"
INSTALLED_KEY = "key.json"


logger = logging.getLogger("fastcast")

# Seconds the successful load took, and the loaded module. Process facts: the library is
# loaded at most once per process (a second load would register its operators twice),
# under a lock, since two threads may quantize for the first time together.
_loaded_seconds: float | None = None
_module: ModuleType | None = None
_load_lock = threading.Lock()


class BuildError(RuntimeError):
    """The C++ operators could not be built or loaded."""


def _digest(files: tuple[Path, ...]) -> str:
    sources = hashlib.sha256()
    for source in files:
        sources.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return sources.hexdigest()


def abi_key() -> dict[str, str]:
    """What a finished library must have been built for to be loaded here: the sources,
    the flags, the Python ABI and the torch build (its version, its commit and C++ ABI;
    not its location, so that a wheel built against this torch elsewhere loads). The
    library installed with the package is loaded only when its key equals this one.
    Cheap (no compiler, no ``cpp_extension`` import). Raises ``OSError`` when a source
    file is missing (an incomplete install)."""
    return {
        "sources": _digest((*SOURCES, *HEADERS)),
        "cflags": " ".join(CFLAGS),
        "ldflags": " ".join(LDFLAGS),
        "python": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}",
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
        "sources": _digest((*SOURCES, *HEADERS)),
        "compiler": os.path.realpath(found) if found else f"{compiler} (not found)",
        "compiler_version": _compiler_version(found),
        "cflags": " ".join(CFLAGS),
        "ldflags": " ".join(LDFLAGS),
        "include_paths": os.pathsep.join(
            [*cpp_extension.include_paths(), sysconfig.get_path("include") or ""]
        ),
        "python": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}",
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


def load() -> float:
    """Build (if needed) and load the library; returns the seconds it took.

    Raises ``BuildError`` with the reason when it cannot (any failure: a missing source
    file, compiler or ninja, a compile error, a library that does not load)."""
    global _loaded_seconds, _module
    with _load_lock:
        if _loaded_seconds is not None:
            return _loaded_seconds
        from . import installed  # noqa: PLC0415 - a build's child runs this file alone

        start = time.perf_counter()
        try:
            module = installed.load(INSTALLED_LIBRARY, INSTALLED_KEY, abi_key(), _say, _import)
            if module is None:  # none installed, or not for this torch: build or find it
                key = build_key()
                with _exclusive(build_dir(key)):
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


def _say(message: str) -> None:
    """A line on stderr: the build stalls the first quantize for tens of seconds, which
    must be visible without any logging set-up."""
    print(f"fastcast: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s lock (across processes; the OS releases it if the holder
    dies), saying so when another process has it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process that is building the fused kernels in {directory}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_or_import(directory: Path, key: dict[str, str]) -> ModuleType:
    """The library of ``directory``: imported when a finished build is there, else built
    (the caller holds the directory's lock)."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, first use only

    library = directory / f"{NAMESPACE}{cpp_extension.LIB_EXT}"
    stamp = directory / BUILT_STAMP
    if stamp.exists() and library.exists():
        try:
            return _import(library)
        except ImportError as exc:  # a damaged file: build it again
            logger.warning("fastcast: rebuilding the fused kernels (%s)", exc)
            stamp.unlink()
    _say(
        "building the fused C++ quantize kernels (first use with this compiler, Python "
        f"and torch; about 30-60 s on two cores) in {directory}"
    )
    with _build_step("fused kernels", directory, key):
        _compile_in_child("cpu", directory)
    return _import(library)


@contextlib.contextmanager
def _build_step(what: str, directory: Path, key: dict[str, str]) -> Iterator[None]:
    """Around one library's compile (the caller holds the directory's lock): the time it
    took said on stderr, and the ``built`` stamp once it succeeded."""
    start = time.perf_counter()
    try:
        # torch's own lock file: left behind by a build that was killed, it would make
        # cpp_extension wait forever. Nobody else is building here: we hold the lock.
        (directory / "lock").unlink(missing_ok=True)
        yield
    except Exception:
        _say(f"building the {what} failed after {time.perf_counter() - start:.1f} s")
        raise
    (directory / BUILT_STAMP).write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
    _say(f"built the {what} in {time.perf_counter() - start:.1f} s")


def _compile_in_child(kind: str, directory: Path, *args: str) -> None:
    """Compile library ``kind`` (``child_main``) into ``directory`` in a child process
    whose environment is this one's with ninja on ``PATH`` (``_child``); ``BuildError``
    with the end of its output when it fails."""
    from . import _child  # noqa: PLC0415 - not in a build's child (no package)

    env = _child.environment(os.environ)
    done = _child.run([kind, str(directory), *args], env, cwd=directory)
    if done.returncode != 0:
        raise BuildError(_child.tail(done.stderr + done.stdout))


def _copy_sources(
    target: Path,
    sources: tuple[Path, ...] = SOURCES,
    headers: tuple[Path, ...] = HEADERS,
) -> list[Path]:
    """The sources and headers copied into ``target`` at their paths under ``csrc/`` (the
    sources' paths returned): ninja's commands name them there, the same for every
    install, and ``#include "../element.h"`` finds its file. A copy is written only when
    it differs, so ninja sees no newer file on a later build."""
    for source in (*sources, *headers):
        text = source.read_bytes()
        copy = target / source.relative_to(CSRC)
        copy.parent.mkdir(parents=True, exist_ok=True)
        if not copy.exists() or copy.read_bytes() != text:
            partial = copy.with_suffix(copy.suffix + ".partial")
            partial.write_bytes(text)
            os.replace(partial, copy)
    return [target / s.relative_to(CSRC) for s in sources]


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAMESPACE, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- The CUDA library ---------------------------------------------------------------

# Seconds the CUDA library took to load, or the BuildError it failed with: a process
# fact like the CPU library's (tried at most once per process; its registrations would
# clash on a second load).
_cuda_loaded: float | BuildError | None = None


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
        "cuda_sources": _digest((*CUDA_SOURCES, *CUDA_HEADERS)),
        "nvcc": compiler or "(not found)",
        "nvcc_version": _compiler_version(compiler, "release"),
        "nvcc_flags": " ".join(NVCC_FLAGS),
        # TORCH_CUDA_ARCH_LIST, else the visible GPUs: what the kernels are compiled for.
        "cuda_arch": " ".join(cpp_extension._get_cuda_arch_flags()),
        "torch_cuda": str(torch.version.cuda),
    }


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
            with _exclusive(directory):
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
    _say(
        "building the CUDA quantize kernels (first use with this nvcc, torch and GPU; "
        f"about a minute) in {directory}"
    )
    with _build_step("CUDA kernels", directory, key):
        _compile_in_child("cuda", directory, str(library_path()))
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
