"""What the fused-kernel libraries are built from and named: the source files, the flags,
the operators, and the files of a build directory and of an install. Plain values (no
torch), read by the build's child process too.
"""

from __future__ import annotations

from pathlib import Path

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
