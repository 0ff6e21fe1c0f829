"""The quantize operators as Inductor compiles them: the fused kernels on CUDA (Triton).

Each function here has the signature and the results of the C++ operator of the same
name (``fake.py`` has their shapes) and computes them by calling the PyTorch reference
(``fastcast.reference``), so its values are the reference's. ``ops()`` wraps each in
``torch.compile(dynamic=True, fullgraph=True)``: one wrapper per operator, made once per
process, compiled at its first call (never at import), once per dtype and flags rather
than per shape. Inductor's FX graph and AOTAutograd caches keep the compiled code on disk
(``TORCHINDUCTOR_CACHE_DIR``), so a later process traces again but does not recompile.

Randomness stays outside the graphs: NVFP4's stochastic rounding takes its numbers as
tensors, drawn by the caller as the reference draws them (``nvfp4._draws``), so the
results are the reference's bit for bit, generator state included.

``scaled_mm_tensorwise`` has no compiled form: on CUDA ``torch._scaled_mm`` runs the FP8
tensor cores, which a compiled emulation could only slow down, and on the CPU its values
are those of the C++ GEMM (which only saves passes).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..formats import ELEMENT_MAX, FP8_DTYPES
from ..reference import mx, nvfp4, rows, tiles
from ..reference.amax import record_amax_reference
from ..reference.cast import as_matrix, scale_and_cast, scale_from_amax, tensor_amax
from ..reference.decode import apply_scales, decode_e8m0, unpack_e2m1

_FORMATS = {dtype: fmt for fmt, dtype in FP8_DTYPES.items()}

# Each distinct dtype, format and flag set is a graph of its own (shapes are symbolic).
# A run quantizes with a handful; Dynamo's default of 8 per function would make the
# ninth an error (fullgraph). The limit is per wrapper (isolate_recompiles).
RECOMPILE_LIMIT = 64
# torch.compile takes the limit per function from torch 2.12 on (users run 2.9+).
_PER_FUNCTION_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def quantize_tensorwise(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    power_2: bool,
    epsilon: float,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fmt = _FORMATS[dtype]
    if scale is None:  # current scaling (scale from this tensor), else quantize_with_scale
        amax = tensor_amax(x)
        scale = scale_from_amax(amax, ELEMENT_MAX[fmt], power_2=power_2, epsilon=epsilon)
    data = scale_and_cast(x, scale, fmt)
    data_t = as_matrix(data).t().contiguous() if columnwise else data.new_empty(0)
    return (data if rowwise else data.new_empty(0)), scale.reciprocal(), data_t


def quantize_recording(
    x: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    record_amax_reference(slot, x)  # one graph: Inductor reads x once for both
    return scale_and_cast(x, scale, _FORMATS[dtype]), scale.reciprocal()


def quantize_rows(
    m: torch.Tensor, dtype: torch.dtype, power_2: bool, columns: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return rows.quantize_rows_reference(m, _FORMATS[dtype], power_2, columns)


def quantize_blocks(
    m: torch.Tensor, tile_rows: int, dtype: torch.dtype, power_2: bool, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return tiles.quantize_tiles_reference(m, tile_rows, _FORMATS[dtype], power_2, epsilon)


def quantize_mxfp8(
    m: torch.Tensor, dtype: torch.dtype, ocp: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return mx.quantize_blocks_reference(m, _FORMATS[dtype], "ocp" if ocp else "rceil")


def dequantize_blocks(
    data: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int
) -> torch.Tensor:
    # QuantizedTensor._dequantize_layout's reference: FP8 codes widen exactly; the scales
    # are FP32, or MXFP8's E8M0 bytes (which the operators decode themselves).
    values = decode_e8m0(scales) if scales.dtype == torch.uint8 else scales.float()
    return apply_scales(data.float(), values, (block_rows, block_cols))


def dequantize_nvfp4(
    data: torch.Tensor, scales: torch.Tensor, global_scale_inv: torch.Tensor, block_rows: int
) -> torch.Tensor:
    # NVFP4Tensor's reference: E2M1 codes unpacked, each block's E4M3 scale times the
    # tensor scale (rounded to FP32), then the values times their block's scale.
    values = unpack_e2m1(data)
    return apply_scales(values, scales.float() * global_scale_inv.float(), (block_rows, 16))


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantize_tensorwise": quantize_tensorwise,
    "record_amax": record_amax_reference,  # the reference has the operator's signature
    "quantize_recording": quantize_recording,
    "quantize_blocks": quantize_blocks,
    "quantize_rows": quantize_rows,
    "quantize_mxfp8": quantize_mxfp8,
    "quantize_nvfp4": nvfp4.quantize_reference,  # likewise
    "dequantize_blocks": dequantize_blocks,
    "dequantize_nvfp4": dequantize_nvfp4,
}

# The compiled wrappers by operator name, made once per process (a process fact: each
# compiles its graphs on first use and keeps them).
_ops: dict[str, Callable[..., Any]] | None = None
_lock = threading.Lock()


def ops() -> dict[str, Callable[..., Any]]:
    """The compiled operators by name (``FUNCTIONS``' keys)."""
    global _ops
    with _lock:
        if _ops is None:
            _ops = {name: _compile(name, fn) for name, fn in FUNCTIONS.items()}
        return _ops


def _compile(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if _PER_FUNCTION_LIMIT:
        graphs = torch.compile(
            fn,
            dynamic=True,
            fullgraph=True,
            recompile_limit=RECOMPILE_LIMIT,
            isolate_recompiles=True,
        )
        limit: Any = contextlib.nullcontext
    else:
        # torch before 2.12 takes the limit from Dynamo's config only: raised for these
        # calls (each a code object of its own), not for the user's compiled code.
        graphs = torch.compile(fn, dynamic=True, fullgraph=True)
        limit = functools.partial(torch._dynamo.config.patch, recompile_limit=RECOMPILE_LIMIT)

    def call(*args: Any) -> Any:
        # As the C++ operators: no autograd (outputs are codes and scales), so the graphs
        # are inference graphs, the same under grad mode or not.
        with torch.no_grad(), limit():
            return graphs(*[_plain(a) for a in args])

    call.__name__ = call.__qualname__ = name  # the operator's
    return call


def _plain(arg: Any) -> Any:
    """A tensor argument as a plain tensor over the same memory (0.3 us): Dynamo keys
    graphs on more than shapes otherwise. A parameter gets static shapes
    (``force_parameter_static_shapes``: a graph per weight shape), a view is traced
    with its base (a graph per base rank), and ``requires_grad`` is guarded."""
    return arg.detach() if isinstance(arg, torch.Tensor) else arg
