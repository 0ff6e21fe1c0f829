"""The quantizer protocol and the arithmetic every scaling family shares."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..formats import FP8_DTYPES
from ..tensor import QuantizedTensor

ROLES = ("input", "weight", "grad_output")
PER_ROW = (1, 0)  # the block of one scale per row (``tensor.QuantizedTensor``)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@runtime_checkable
class Quantizer(Protocol):
    """Turns a high-precision tensor into a QuantizedTensor.

    ``rowwise`` produces the layout scaled along the last dim, ``columnwise`` the
    transposed one scaled along the other dim (what backward GEMMs contract over).

    Optionally, for grouped (mixture-of-experts) GEMMs, ``quantize_groups(m, groups, *,
    columnwise)`` quantizes each group of rows as a tensor of its own, on the device, and
    ``token_block`` says what its column-wise layout needs each group to start at a
    multiple of (``quantizers.groups``); a quantizer without them is called per group.
    """

    fmt: str

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> QuantizedTensor: ...


def check_input(x: object, what: str = "input") -> torch.Tensor:
    """Refuse what cannot be quantized, naming the problem."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{what} must be float32, bfloat16 or float16 to be quantized, got {x.dtype}"
        )
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension to be quantized")
    return x


def check_fp8_format(owner: str, fmt: object) -> str:
    """``fmt`` if it names an FP8 element format (``e4m3`` or ``e5m2``), else ValueError."""
    if fmt not in FP8_DTYPES:
        raise ValueError(f"{owner}: fmt must be e4m3 or e5m2, got {fmt!r}")
    return fmt  # type: ignore[return-value]


def transposed_codes(codes: torch.Tensor) -> torch.Tensor:
    """The column-wise layout ``[K, R]`` of codes cast in the matrix's own layout ``[R, K]``
    (per-tensor and row-wise FP8: casting is elementwise, so the transposed bytes are the
    codes of the transposed matrix). The CPU GEMM and the emulation take the transposed
    view as it is; CUDA kernels, and Inductor's lowering of the CPU kernel, want it
    materialised."""
    codes_t = codes.t()
    if not codes_t.is_cpu or torch.compiler.is_compiling():
        codes_t = codes_t.contiguous()
    return codes_t
