"""Scaled GEMM ``a @ b.T`` of two quantized operands.

Two paths, chosen once per (device type, scaling family) by ``hardware.gemm_backend``:

- hardware: ``torch._scaled_mm`` over the FP8 data with per-tensor or per-row scales;
- emulation: dequantize both operands to FP32 and matmul (FP32 accumulation), which is
  what the tensor cores compute, up to FP32 rounding. Every family has it.

``backend="hardware" | "emulate"`` forces a path for one call (tests compare the two).
"""

from __future__ import annotations

import torch

from .gemm_microscaled import scaled_mm_microscaled
from .kernels import fused_op
from .reference.tiles import TILE
from .runtime import hardware
from .runtime.observers import attached as _observers
from .runtime.observers import begin as _begin
from .runtime.observers import end as _end
from .tensor import MXFP8, NVFP4, WHOLE, QuantizedTensor

BACKENDS = ("hardware", "emulate")


def scaled_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``a @ b.T`` (+ ``bias``) in ``out_dtype``, contracting the last dim of both.

    ``a`` is ``[..., K]`` (leading dims kept in the output), ``b`` is ``[N, K]``; both
    use their row-wise layouts (``w.t()`` gives the transposed operand when ``w`` was
    quantized with ``columnwise=True``). With ``accumulate`` (an FP32 ``[.., N]``
    tensor) the product is added into it in place and it is returned, as for
    gradient accumulation.
    """
    family, device_type = _check_operands(a, b)
    if backend is None:
        chosen, reason = hardware.gemm_backend(device_type, family)
        if chosen is None:
            raise RuntimeError(f"scaled_mm: {reason}")
    elif backend in BACKENDS:
        chosen = backend
        if backend == "hardware" and not hardware.has_kernel(device_type, family):
            raise RuntimeError(
                f"scaled_mm: no torch._scaled_mm kernel for {family} scaling on {device_type}"
            )
    else:
        raise ValueError(f"scaled_mm: backend must be one of {BACKENDS} or None, got {backend!r}")
    return _product(a, b, out_dtype, bias, accumulate, chosen, device_type)


def operands_product(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scaled_mm`` of operands fastcast made itself (``fc.Linear``'s GEMMs): the same
    product on the chosen backend, without re-checking what the quantizers guarantee
    (types, layouts, shapes, devices), which costs as much as a 16x16 GEMM."""
    data = a.data
    device_type = "cpu" if data.is_cpu else data.device.type
    chosen, reason = hardware.gemm_backend(device_type, _product_family(a, b))
    if chosen is None:
        raise RuntimeError(f"scaled_mm: {reason}")
    return _product(a, b, out_dtype, bias, None, chosen, device_type)


def _product(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    chosen: str,
    device_type: str,
) -> torch.Tensor:
    opened = _begin("fastcast.scaled_mm") if _observers else None  # observer point
    try:
        hardware_path = chosen == "hardware" and runs_kernel(a, b, device_type)
        gemm = _scaled_mm_hardware if hardware_path else _scaled_mm_emulated
        if torch.is_autocast_enabled(device_type):
            # torch.autocast would run the FP32 accumulation and scales in its low dtype.
            with torch.autocast(device_type, enabled=False):
                out = gemm(a, b, out_dtype, bias, accumulate)
        else:
            out = gemm(a, b, out_dtype, bias, accumulate)
        if len(a.shape) != 2 and accumulate is None:
            # Reshape the fresh contiguous product in place rather than return a view: an
            # autograd Function's view output would forbid in-place ops after the layer
            # (y += residual, ReLU(inplace=True)) that nn.Linear's output allows.
            shape = (*a.shape[:-1], b.shape[0])
            # (Dynamo cannot trace resize_; a compiled graph has no such view restriction.)
            out = out.reshape(shape) if torch.compiler.is_compiling() else out.resize_(*shape)
        return out
    finally:
        if opened is not None:
            _end(opened)


def _check_operands(a: QuantizedTensor, b: QuantizedTensor) -> tuple[str, str]:
    """``(family, device type)`` of the product; errors name what is wrong. (Per GEMM:
    written for the common case, two CPU or two CUDA operands.)"""
    if not (isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor)):
        name, x = ("a", a) if not isinstance(a, QuantizedTensor) else ("b", b)
        raise TypeError(
            f"scaled_mm: {name} must be a quantized tensor (fc.quantize), got {type(x).__name__}"
        )
    a_data, b_data = a.data, b.data
    if a_data is None or b_data is None:
        raise ValueError(
            f"scaled_mm: {'a' if a_data is None else 'b'} has no row-wise data; quantize it "
            "with rowwise=True (or pass .t() of a tensor quantized with columnwise=True)"
        )
    b_shape = b.shape
    if len(b_shape) != 2:
        raise ValueError(f"scaled_mm: b must be 2D [N, K], got shape {tuple(b_shape)}")
    if a.shape[-1] != b_shape[-1]:
        raise ValueError(
            f"scaled_mm: contraction dims differ: a is {tuple(a.shape)}, b is {tuple(b_shape)}"
        )
    if a_data.is_cpu and b_data.is_cpu:
        device_type = "cpu"
    else:
        device = a_data.device
        if device != b_data.device:
            raise ValueError(
                f"scaled_mm: operands on different devices: {device} and {b_data.device}"
            )
        device_type = device.type
    return _product_family(a, b), device_type


def _product_family(a: QuantizedTensor, b: QuantizedTensor) -> str:
    """The GEMM family of ``a @ b.T``: mixed families have no common kernel (the
    emulation handles any pair)."""
    fa, fb = a.family, b.family
    return fa if fa == fb else "mixed"


def runs_kernel(a: QuantizedTensor, b: QuantizedTensor, device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` computes this product, on a device that has a kernel
    for its family: on CUDA within the kernel's shape limits, on the CPU always (under
    ``torch.compile`` the CPU emulates instead: ``fastcast.compile`` says why)."""
    return device_type != "cuda" or _fits_cuda_kernel(a, b)


def _fits_cuda_kernel(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Shape and format limits of the CUDA FP8 kernels (the CPU kernel has none)."""
    k, n = a.shape[-1], b.shape[0]
    both_e5m2 = a.fmt == "e5m2" and b.fmt == "e5m2"
    fits = k % 16 == 0 and n % 16 == 0 and not both_e5m2
    if a.fmt == "e2m1":  # NVFP4: two codes a byte, and the kernel wants K/2 bytes % 16
        return fits and k % 32 == 0
    if fits and a.block[1] == TILE:
        # Whole 128-element tiles along K, and whole 128-row tiles for 128x128 operands
        # (cuBLASLt's block-scaled GEMM has no partial tiles).
        m = a.data.numel() // k
        fits = k % TILE == 0 and m % a.block[0] == 0 and n % b.block[0] == 0 and m % 16 == 0
    return fits


def _scaled_mm_hardware(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
) -> torch.Tensor:
    if a.family in _MICROSCALED and a.data.is_cuda:
        if not _block_kernel_writes(out_dtype, bias, accumulate):
            return _scaled_mm_emulated(a, b, out_dtype, bias, accumulate)
        return scaled_mm_microscaled(a, b, out_dtype)
    a2 = a.data if len(a.shape) == 2 else a.data.reshape(-1, a.shape[-1])
    b2 = b.data
    if a2.is_cuda:  # cuBLASLt wants a row-major a and a column-major b.T
        a2, b2 = a2.contiguous(), b2.contiguous()
    scale_a, scale_b = a.scale_inv, b.scale_inv
    if b.block == (1, 0):  # per-row scales of b are per-column scales of b.T
        scale_a, scale_b = scale_a.reshape(-1, 1), scale_b.reshape(1, -1)
    # The kernel adds a bias of the output dtype in its FP32 epilogue; any other bias,
    # or an accumulation, needs the FP32 product first.
    # (cuBLASLt fuses 16-bit biases only; the CPU kernel any.)
    fuse_bias = (
        bias is not None
        and bias.dtype == out_dtype
        and accumulate is None
        and (out_dtype != torch.float32 or a2.is_cpu)
    )
    direct = accumulate is None and (bias is None or fuse_bias)
    if b.block == (1, 0) and a2.is_cuda:
        # Per-row scales on CUDA: CUTLASS's kernel needs an E4M3 b and writes bf16 only
        # (cuBLAS on sm90 any dtype); other products are emulated, to FP32 rounding.
        dtype = out_dtype if direct else torch.float32
        if b.fmt != "e4m3" or not hardware.cuda_rowwise_output(dtype):
            return _scaled_mm_emulated(a, b, out_dtype, bias, accumulate)
    if a.block[1] == TILE and a2.is_cuda:
        return _scaled_mm_blocks(a, b, a2, b2, out_dtype, bias, accumulate)
    per_tensor = a.block == b.block == WHOLE
    fused = fused_op("scaled_mm_tensorwise", a2) if per_tensor else None
    if fused is not None:  # the same values, without the CPU kernel's separate passes
        out = fused(
            a2,
            b2,
            scale_a,
            scale_b,
            bias if fuse_bias else None,
            out_dtype if direct else torch.float32,
        )
        return _finish(out, out_dtype, None if fuse_bias else bias, accumulate)
    out = torch._scaled_mm(
        a2,
        b2.t(),
        scale_a=scale_a,
        scale_b=scale_b,
        bias=bias if fuse_bias else None,
        out_dtype=out_dtype if direct else torch.float32,
    )
    return _finish(out, out_dtype, None if fuse_bias else bias, accumulate)


def _scaled_mm_blocks(
    a: QuantizedTensor,
    b: QuantizedTensor,
    a2: torch.Tensor,
    b2: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
) -> torch.Tensor:
    """1x128 / 128x128 tiles on the GPU's block-scaled kernel (``F.scaled_mm``)."""
    if not _block_kernel_writes(out_dtype, bias, accumulate):
        return _scaled_mm_emulated(a, b, out_dtype, bias, accumulate)
    functional = torch.nn.functional
    return functional.scaled_mm(
        a2,
        b2.t(),
        _kernel_tile_scales(a),
        _tile_recipe(a),
        _kernel_tile_scales(b),
        _tile_recipe(b),
        output_dtype=out_dtype,
    )


# Families whose CUDA product is ``gemm_microscaled``'s (sm100's MX / NV kernels).
_MICROSCALED = (MXFP8, NVFP4)


def _block_kernel_writes(
    out_dtype: torch.dtype, bias: torch.Tensor | None, accumulate: torch.Tensor | None
) -> bool:
    """Whether a block-scaled kernel writes the product asked for: they write bfloat16;
    a bias or an accumulation needs the FP32 product, which they do not write, so those
    products are emulated (never rounded through bfloat16)."""
    return accumulate is None and bias is None and hardware.cuda_block_output(out_dtype)


def _tile_recipe(q: QuantizedTensor) -> object:
    scaling = torch.nn.functional.ScalingType
    return scaling.BlockWise1x128 if q.block[0] == 1 else scaling.BlockWise128x128


def _kernel_tile_scales(q: QuantizedTensor) -> torch.Tensor:
    """An operand's tile scales in the layout cuBLASLt reads (torch's meta checks say
    which): 1x128 scales ``[rows, K/128]`` column-major; 128x128 scales transposed to
    ``[K/128 padded to 4, rows/128]``, column-major."""
    scales = q.scale_inv
    if q.block[0] == 1:
        return scales.t().contiguous().t()
    pad = -scales.shape[1] % 4
    if pad:
        scales = torch.nn.functional.pad(scales, (0, pad))
    return scales.contiguous().t()


def _scaled_mm_emulated(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
) -> torch.Tensor:
    out = a.dequantize_rowwise_2d() @ b.dequantize_rowwise_2d().t()
    return _finish(out, out_dtype, bias, accumulate)


def _finish(
    out: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
) -> torch.Tensor:
    """Add bias (in FP32, before rounding to ``out_dtype``) or accumulate into a buffer."""
    if accumulate is not None:
        if bias is not None:
            out = out + bias.float()
        return accumulate.add_(out.reshape(accumulate.shape))
    if bias is not None:
        out = out.add_(bias)  # out is FP32 here
    return out if out.dtype == out_dtype else out.to(out_dtype)
