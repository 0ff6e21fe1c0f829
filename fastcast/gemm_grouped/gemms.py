"""The three grouped GEMMs (forward, dgrad, wgrad), each on the hardware or emulated.

``torch._scaled_grouped_mm`` runs where ``hardware.grouped_gemm_backend`` says it can
(per-tensor and row-wise families, E4M3 operands), with its operands laid out here
(``operands_2d_3d``, ``operands_2d_2d``); otherwise the emulated operands
(``emulation.py``) are multiplied by ``torch._grouped_mm`` in FP32, through an opaque
operator under tracing (its own fake kernel refuses FP32).
"""

from __future__ import annotations

import torch

from ..formats import ELEMENT_MAX
from ..reference.cast import scale_and_cast, scale_from_amax
from ..reference.rows import row_amax
from ..runtime import hardware
from ..tensor import TENSORWISE
from .emulation import quantize_columns, quantize_rows, quantize_weight
from .groups import group_amax, pad_groups
from .scaling import GroupedScaling


@torch.library.custom_op("fastcast::grouped_mm_fp32", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` as an opaque operator for traced code: its own fake kernel
    (that of torch 2.13) refuses anything but bf16, though the CPU kernel runs FP32."""
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:  # tokens x experts: [T, N]
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])  # grouped along K: [E, M, N]


def _grouped_mm_fp32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    device_type = a.device.type
    mm = _grouped_mm_op if torch.compiler.is_compiling() else torch._grouped_mm
    if torch.is_autocast_enabled(device_type):  # it would run the product in 16 bits
        with torch.autocast(device_type, enabled=False):
            return mm(a, b, offs=offs)
    return mm(a, b, offs=offs)


def _hardware(s: GroupedScaling, device_type: str, *fmts: str) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs this GEMM (E4M3 operands only)."""
    backend, reason = hardware.grouped_gemm_backend(device_type, s.family)
    if backend is None:
        raise RuntimeError(f"grouped GEMM: {reason}")
    return backend == "hardware" and all(f == "e4m3" for f in fmts)


def _row_codes(
    m: torch.Tensor, s: GroupedScaling, role: str, gid: torch.Tensor, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes of ``m`` ``[R, D]`` along D and their per-row dequantization scales
    ``[R]`` (a group's per-tensor scale repeated over its rows): the hardware operands."""
    fmt = s.fmt(role)
    amax = row_amax(m, 1).squeeze(1)
    if s.family == TENSORWISE:
        amax = group_amax(amax, gid, groups)[gid]
    scale = scale_from_amax(
        amax, ELEMENT_MAX[fmt], margin=s.margin, power_2=s.power_2, epsilon=s.epsilon
    )
    return scale_and_cast(m, scale.unsqueeze(1), fmt), scale.reciprocal()


def grouped_forward(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    s: GroupedScaling,
    gid: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``out[t] = x[t] @ w[group(t)].T`` quantized as ``s`` says; ``[T, N]``."""
    experts = w.shape[0]
    if _hardware(s, x.device.type, s.fmt_input, s.fmt_weight):
        return _scaled_2d_3d(x, w, offs, s, gid, ("input", "weight"), out_dtype)
    xq = quantize_rows(x, s, "input", gid, experts)
    wq = quantize_weight(w, s)
    return _grouped_mm_fp32(xq, wq.transpose(1, 2), offs).to(out_dtype)


def grouped_dgrad(
    g: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    s: GroupedScaling,
    gid: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dx[t] = g[t] @ w[group(t)]``; ``[T, K]``."""
    experts = w.shape[0]
    wt_family = TENSORWISE if s.wgrad_high_precision else s.family
    if wt_family == s.family and _hardware(s, g.device.type, s.fmt_grad, s.fmt_weight):
        return _scaled_2d_3d(
            g, w.transpose(1, 2), offs, s, gid, ("grad_output", "weight"), out_dtype
        )
    gq = quantize_rows(g, s, "grad_output", gid, experts)
    wq = quantize_weight(w, s, along_n=True)
    return _grouped_mm_fp32(gq, wq, offs).to(out_dtype)


def grouped_wgrad(
    g: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    s: GroupedScaling,
    gid: torch.Tensor,
    experts: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dw[e] = g[group e].T @ x[group e]``; ``[E, N, K]`` (zero for an empty group)."""
    if s.wgrad_high_precision:
        dtype = g.dtype if g.dtype == x.dtype else torch.float32
        return _grouped_mm_fp32(g.t().to(dtype).float(), x.float(), offs).to(out_dtype)
    block = s.block
    if _hardware(s, g.device.type, s.fmt_grad, s.fmt_input):
        block = 16  # the kernel's K alignment: each group's tokens a multiple of 16
    gp, offs_p, gid_p = pad_groups(g, offs, gid, block)
    xp, _, _ = pad_groups(x, offs, gid, block)
    if _hardware(s, g.device.type, s.fmt_grad, s.fmt_input):
        return _scaled_2d_2d(gp, xp, offs_p, s, gid_p, experts, out_dtype)
    gq = quantize_columns(gp, s, "grad_output", gid_p, experts)
    xq = quantize_columns(xp, s, "input", gid_p, experts)
    return _grouped_mm_fp32(gq.t(), xq, offs_p).to(out_dtype)


def _scaled_2d_3d(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    s: GroupedScaling,
    gid: torch.Tensor,
    roles: tuple[str, str],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` of tokens ``a`` ``[T, K]`` and experts ``b``
    ``[E, N, K]`` (bf16 out, the kernel's only output)."""
    args = operands_2d_3d(a, b, gid, s, roles)
    return torch._scaled_grouped_mm(*args, offs=offs, out_dtype=torch.bfloat16).to(out_dtype)


def operands_2d_3d(
    a: torch.Tensor,
    b: torch.Tensor,
    gid: torch.Tensor,
    s: GroupedScaling,
    roles: tuple[str, str],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a codes, b codes, a scales, b scales)`` in the layouts the kernel takes:
    row-major ``[T, K]`` and column-major ``[E, K, N]`` E4M3, per-row scales ``[T]`` (per
    token, or the token's group's) and ``[E, N]`` (per expert row, or per expert)."""
    experts, n, k = b.shape
    a_codes, a_scale = _row_codes(a, s, roles[0], gid, experts)
    b_gid = torch.arange(experts, device=b.device).repeat_interleave(n)
    b_codes, b_scale = _row_codes(b.reshape(experts * n, k), s, roles[1], b_gid, experts)
    b_codes = b_codes.reshape(experts, n, k).transpose(1, 2)  # column-major [E, K, N]
    return (
        a_codes.contiguous(),
        b_codes,
        a_scale.contiguous(),
        b_scale.reshape(experts, n).contiguous(),
    )


def _scaled_2d_2d(
    gp: torch.Tensor,
    xp: torch.Tensor,
    offs_p: torch.Tensor,
    s: GroupedScaling,
    gid_p: torch.Tensor,
    experts: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` of ``gp.T`` ``[N, Tp]`` and ``xp`` ``[Tp, K]`` grouped
    along the tokens (bf16 out)."""
    args = operands_2d_2d(gp, xp, s, gid_p, experts)
    return torch._scaled_grouped_mm(*args, offs=offs_p, out_dtype=torch.bfloat16).to(out_dtype)


def operands_2d_2d(
    gp: torch.Tensor, xp: torch.Tensor, s: GroupedScaling, gid_p: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight-gradient operands: row-major ``gp.T`` and column-major ``xp`` codes,
    scales per (group, feature) of each (the group's one scale for per-tensor scaling),
    flattened group by group: ``[E * N]`` and ``[E * K]``."""
    codes, scales = [], []
    for m, role in ((gp, "grad_output"), (xp, "input")):
        fmt = s.fmt(role)
        rows, cols = m.shape
        amax = torch.zeros(experts, cols, dtype=torch.float32, device=m.device)
        index = gid_p.unsqueeze(1).expand(rows, cols)
        amax.scatter_reduce_(0, index, m.float().abs(), "amax", include_self=True)
        if s.family == TENSORWISE:
            amax = amax.amax(dim=1, keepdim=True).expand(experts, cols)
        scale = scale_from_amax(
            amax, ELEMENT_MAX[fmt], margin=s.margin, power_2=s.power_2, epsilon=s.epsilon
        )
        codes.append(scale_and_cast(m, scale[gid_p], fmt))
        scales.append(scale.reciprocal().reshape(-1).contiguous())
    a = codes[0].t().contiguous()  # row-major [N, Tp]
    b = codes[1].t().contiguous().t()  # column-major [Tp, K]
    return a, b, scales[0], scales[1]
