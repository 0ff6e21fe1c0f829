"""The CUDA kernels compile without a GPU: every ``.cu`` of ``build.CUDA_SOURCES`` to
cubins for Hopper (sm_90a) and Blackwell (sm_100a) with ptxas' resource report, against
this torch's headers, with the flags the real build passes. A compile error or any
register spill fails; the registers of every kernel are recorded (``record_property``,
and printed: ``pytest -s``). The host glue (operator registration) compiles once too.

A CPU wheel of torch ships the ``ATen/cuda`` and ``c10/cuda`` headers but not the
generated ``c10/cuda/impl/cuda_cmake_macros.h``: a one-line stand-in is written to a
temporary include directory. Skipped only where no nvcc is found; nvcc takes tens of
seconds per file and architecture on two cores, so these are ``slow`` tests.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from fastcast.kernels import build

ARCHS = ("sm_90a", "sm_100a")
RUN_SLOW = os.environ.get("FASTCAST_SLOW_TESTS") == "1"


def find_nvcc() -> str | None:
    """nvcc from CUDA_HOME (as the build finds it), else PATH, else /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME]
    for home in candidates:
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


NVCC = find_nvcc()


def runs_nvcc(test):
    """Marks a test that runs nvcc: ``slow``, skipped without FASTCAST_SLOW_TESTS=1, and
    skipped (with the reason) where no nvcc is found."""
    test = pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine (CUDA_HOME, PATH)")(
        test
    )
    reason = "nvcc runs for minutes on two cores: set FASTCAST_SLOW_TESTS=1 (make test-slow)"
    return pytest.mark.skipif(not RUN_SLOW, reason=reason)(pytest.mark.slow(test))


@pytest.fixture(scope="module")
def include_flags(tmp_path_factory) -> list[str]:
    """-I/-isystem flags: the stand-in header, then torch's include directories."""
    shim = tmp_path_factory.mktemp("cuda-shim")
    macros = shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.parent.mkdir(parents=True)
    # What the generated header holds in a shared-library build of torch.
    macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    flags = [f"-I{shim}"]
    for path in cpp_extension.include_paths():
        flags += ["-isystem", path]
    return flags


def nvcc_command(source: Path, arch: str, output: Path, includes: list[str]) -> list[str]:
    mode = "-cubin" if output.suffix == ".cubin" else "-c"
    return [
        str(NVCC),
        mode,
        f"-arch={arch}",
        "-std=c++17",
        *cpp_extension.COMMON_NVCC_FLAGS,
        *build.NVCC_FLAGS,
        "-Xptxas",
        "-v",
        "-Xcompiler",
        "-fPIC",
        f"-DTORCH_EXTENSION_NAME={build.CUDA_NAME}",
        *includes,
        "-o",
        str(output),
        str(source),
    ]


# ptxas -v, per kernel: "Compiling entry function '<name>' for 'sm_90a'", then
# "<n> bytes stack frame, <n> bytes spill stores, <n> bytes spill loads" and
# "Used <n> registers, ...".
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas(report: str) -> dict[str, dict[str, int]]:
    """Kernel (demangled when c++filt is there) -> registers, stack and spill bytes."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in report.splitlines():
        if m := _ENTRY.search(line):
            current = kernels.setdefault(_demangle(m.group(1)), {})
        elif current is not None and (m := _SPILLS.search(line)):
            current.update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current is not None and (m := _REGISTERS.search(line)):
            current["registers"] = int(m[1])
    return kernels


def _demangle(name: str) -> str:
    tool = shutil.which("c++filt")
    if tool is None:
        return name
    done = subprocess.run([tool, name], capture_output=True, text=True, check=False)
    # Drop the anonymous namespace's unique tag and the parameter list: the template
    # arguments say which instance it is.
    short = re.sub(r"\(anonymous namespace\)::", "", done.stdout.strip() or name)
    return short.split("(")[0]


def test_every_cuda_source_is_listed():
    on_disk = set((build.CSRC / "cuda").glob("*.cu"))
    assert on_disk == set(build.CUDA_SOURCES)


@runs_nvcc
def test_cuda_kernels_compile_without_spills(include_flags, tmp_path, record_property):
    jobs = [(source, arch) for source in build.CUDA_SOURCES for arch in ARCHS]

    def compile_one(job: tuple[Path, str]) -> subprocess.CompletedProcess[str]:
        source, arch = job
        out = tmp_path / f"{source.stem}.{arch}.cubin"
        command = nvcc_command(source, arch, out, include_flags)
        return subprocess.run(command, capture_output=True, text=True, check=False)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_one, jobs))
    table: list[str] = []
    spilled: list[str] = []
    for (source, arch), done in zip(jobs, results, strict=True):
        assert done.returncode == 0, f"{source.name} for {arch}:\n{done.stderr[-6000:]}"
        kernels = parse_ptxas(done.stderr)
        assert kernels, f"no kernel in ptxas' report for {source.name} ({arch})"
        for name, usage in sorted(kernels.items()):
            table.append(
                f"{arch:8} {usage.get('registers', 0):4d} regs "
                f"{usage.get('spill_stores', 0):4d}/{usage.get('spill_loads', 0):4d} spill "
                f"{source.name}: {name}"
            )
            record_property(f"{arch}:{source.name}:{name}", usage)
            if usage.get("spill_stores", 0) or usage.get("spill_loads", 0):
                spilled.append(f"{arch} {name}: {usage}")
    print("\n" + "\n".join(table))
    assert not spilled, "register spills:\n" + "\n".join(spilled)


@runs_nvcc
def test_cuda_host_glue_compiles(include_flags, tmp_path):
    """The operator registrations and launches (host code, which -cubin does not compile)
    against torch's headers, for one architecture."""

    def compile_one(source: Path) -> subprocess.CompletedProcess[str]:
        command = nvcc_command(source, ARCHS[0], tmp_path / f"{source.stem}.o", include_flags)
        return subprocess.run(command, capture_output=True, text=True, check=False)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_one, build.CUDA_SOURCES))
    for source, done in zip(build.CUDA_SOURCES, results, strict=True):
        assert done.returncode == 0, f"{source.name}:\n{done.stderr[-6000:]}"


def test_torch_ships_the_cuda_headers_the_kernels_include():
    """What the stand-in relies on: this torch's include tree has c10/cuda (a wheel
    without it could not compile the kernels at all)."""
    include = Path(torch.__file__).parent / "include"
    assert (include / "c10" / "cuda" / "CUDAStream.h").exists()
