"""What a build's child process runs (``_child.run``): the compiles themselves, and the
install's build of the CPU library (``setup.py``).

The child imports this module from ``fastcast/kernels/`` without importing ``fastcast``
(an install in progress has none), so it imports only modules beside it, torch and the
standard library.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from .directory import build_step, copy_sources, exclusive, import_library, say
from .keys import abi_key, build_dir, build_key
from .sources import (
    BUILT_STAMP,
    CFLAGS,
    CUDA_HEADERS,
    CUDA_NAME,
    CUDA_SOURCES,
    INSTALLED_KEY,
    INSTALLED_LIBRARY,
    LDFLAGS,
    NAMESPACE,
    NVCC_FLAGS,
    SOURCE_COPY,
)


def child_main(args: list[str]) -> int:
    """``cpu DIR`` compiles the CPU library into DIR; ``cuda DIR CPU_LIBRARY`` the CUDA
    library (after loading the CPU one, which defines the operators' schemas);
    ``install DEST`` puts the CPU library into DEST (``install_into``)."""
    kind, target, *rest = args
    if kind == "cpu":
        compile_cpu(Path(target))
    elif kind == "cuda":
        import_library(Path(rest[0]))
        compile_cuda(Path(target))
    elif kind == "install":
        install_into(Path(target))
    else:
        raise ValueError(f"unknown build job {kind!r}")
    return 0


def compile_cpu(directory: Path) -> None:
    """Compile the CPU library into ``directory``, in this process."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, a build only

    sources = copy_sources(directory / SOURCE_COPY)
    cpp_extension.load(
        name=NAMESPACE,
        sources=[str(s) for s in sources],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        is_python_module=True,
        verbose=False,
    )


def compile_cuda(directory: Path) -> None:
    """Compile the CUDA library into ``directory``, in this process."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, a build only

    sources = copy_sources(directory / SOURCE_COPY, CUDA_SOURCES, CUDA_HEADERS)
    cpp_extension.load(
        name=CUDA_NAME,
        sources=[str(s) for s in sources],
        extra_cflags=["-O3"],
        extra_cuda_cflags=list(NVCC_FLAGS),
        build_directory=str(directory),
        is_python_module=False,  # loaded with torch.ops.load_library
        with_cuda=True,
        verbose=False,
    )


def install_into(dest: Path) -> float:
    """At install: the CPU library of this environment's torch, built in its kernel
    directory as on first use (or found there already built, by the same key), copied
    into ``dest`` beside ``INSTALLED_KEY``: its ``abi_key``, the seconds this took,
    where it was built and whether it came from there ready (``from_cache``). Returns
    the seconds."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, a build only

    start = time.perf_counter()
    key = build_key()
    directory = build_dir(key)
    library = directory / f"{NAMESPACE}{cpp_extension.LIB_EXT}"
    with exclusive(directory):
        cached = (directory / BUILT_STAMP).exists() and library.exists()
        if cached:
            say(f"the fused kernels are already built for this torch in {directory}")
        else:
            say(
                f"building the fused C++ quantize kernels for torch {torch.__version__} "
                f"(about 100 s on two cores) in {directory}"
            )
            with build_step("fused kernels", directory, key):
                compile_cpu(directory)
        dest.mkdir(parents=True, exist_ok=True)
        # The key is written last, so that a library is only ever found whole.
        # A new file replaces the old one (never written over: a process may have it
        # loaded).
        (dest / INSTALLED_KEY).unlink(missing_ok=True)
        partial = dest / f"{INSTALLED_LIBRARY}.partial"
        shutil.copyfile(library, partial)
        os.replace(partial, dest / INSTALLED_LIBRARY)
    seconds = time.perf_counter() - start
    record = {
        "key": abi_key(),
        "seconds": round(seconds, 1),
        "built_in": str(directory),
        "from_cache": cached,  # copied from an earlier build: the seconds are the copy's
    }
    (dest / INSTALLED_KEY).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return seconds
