"""Speed, not tracing: what Inductor fuses best, computing the same values as eager.

Each polyfill says what it replaces and why: the FP8 cast (``scale_and_cast``), the CPU's
GEMM choice (``gemm.runs_kernel``) and the fused-kernel choice (``kernels.fused_op``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._dynamo import assume_constant_result

from .. import gemm
from ..formats import ELEMENT_MAX, FP8_DTYPES
from ..kernels import choice as _kernel_choice
from ..reference.cast import scale_and_cast
from ..runtime import hardware

# The machine's answers are fixed for a trace (the GEMM path depends on the device and on
# FASTCAST_GEMM, read when traced): run them at trace time and keep the answers as
# constants, rather than trace into their lru_caches (which Dynamo warns about). This only
# marks the functions; eager calls are unchanged.
for _answer in (
    hardware.gemm_backend,
    hardware.default_device_type,
    hardware.cuda_rowwise_output,
):
    assume_constant_result(_answer)


@torch.compiler.substitute_in_graph(scale_and_cast, skip_signature_check=True)
def _traced_scale_and_cast(x: torch.Tensor, scale: Any, fmt: str) -> torch.Tensor:
    # The same values as eager's scale_and_cast, written for a compiler: eager saves
    # passes with in-place ops and by adding infinity masks to the E5M2 bytes through a
    # uint8 view of a dead buffer, which Inductor turns into slow, unfused index
    # arithmetic (1.7 ms per 256x128 tensor). One select fuses with the cast instead.
    fmt_max = ELEMENT_MAX[fmt]
    y = x.float()
    data = (y * scale).clamp(-fmt_max, fmt_max)  # NaN stays NaN through the clamp
    if fmt == "e4m3":
        # E4M3 (float8_e4m3fn) has no infinity: an input inf becomes NaN, and every NaN
        # the positive one, as eager's nan_to_num makes them (a -NaN kept its sign here).
        data = torch.where(torch.isfinite(y), data, math.nan)
    else:  # an input infinity (which the clamp made +-max) stays infinite in E5M2
        data = torch.where(y.abs() == math.inf, y, data)
    return data.to(FP8_DTYPES[fmt])


@torch.compiler.substitute_in_graph(gemm.runs_kernel, skip_signature_check=True)
def _traced_runs_kernel(a: Any, b: Any, device_type: str) -> bool:
    # A CPU has no FP8 units: torch._scaled_mm's CPU kernel converts both operands to FP32
    # in separate passes, then multiplies. The emulation computes the same product (FP32
    # operands, FP32 accumulation, to FP32 rounding) in a form Inductor fuses: each
    # operand's conversion joins the kernel that quantized it. On the train_step
    # benchmark that is 15 ms a step against 25 ms. Other devices keep their kernels.
    if device_type == "cpu":
        return False
    return device_type != "cuda" or gemm._fits_cuda_kernel(a, b)


@torch.compiler.substitute_in_graph(_kernel_choice.fused_op, skip_signature_check=True)
def _traced_fused_op(name: str, x: torch.Tensor) -> Any:
    # A graph traces the reference quantize, which Inductor fuses with its neighbours
    # (the eager C++ operator would be one opaque call in the graph, and its first use
    # may build the library).
    return None
