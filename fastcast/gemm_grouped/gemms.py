"""The three grouped GEMMs (forward, dgrad, wgrad), each on the hardware or emulated.

``torch._scaled_grouped_mm`` runs where ``hardware.grouped_gemm_backend`` says it can
(per-tensor and row-wise families, E4M3 operands), with the quantizers' codes and scales
laid out here (``operands_2d_3d``, ``operands_2d_2d``); otherwise the emulated operands
(``emulation.py``) are multiplied by ``torch._grouped_mm`` in FP32, through an opaque
operator under tracing (its own fake kernel refuses FP32).
"""

from __future__ import annotations

from typing import Any

import torch

from ..quantizers.groups import quantize_groups
from ..runtime import hardware
from ..token_groups import TokenGroups, pad_groups
from .emulation import token_values, weight_values
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


def _hardware(s: GroupedScaling, device_type: str, *quantizers: Any) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs this GEMM (E4M3 operands only)."""
    backend, reason = hardware.grouped_gemm_backend(device_type, s.family)
    if backend is None:
        raise RuntimeError(f"grouped GEMM: {reason}")
    return backend == "hardware" and all(q.fmt == "e4m3" for q in quantizers)


def grouped_forward(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    s: GroupedScaling,
    gid: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``out[t] = x[t] @ w[group(t)].T`` quantized as ``s`` says; ``[T, N]``."""
    if _hardware(s, x.device.type, s.input_q, s.weight_q):
        return _scaled_2d_3d(x, w, offs, s, gid, ("input", "weight"), out_dtype)
    xq = token_values(s.input_q, x, TokenGroups(gid, w.shape[0]))
    wq = weight_values(s.weight_q, w)
    return _grouped_mm_fp32(xq, wq.transpose(1, 2), offs).to(out_dtype)


def grouped_dgrad(
    g: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    s: GroupedScaling,
    gid: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dx[t] = g[t] @ w[group(t)]``; ``[T, K]``. (A weight scaled per tensor for dgrad,
    the high-precision wgrad's, has no kernel of the row-wise family: emulated.)"""
    if not s.wgrad_high_precision and _hardware(s, g.device.type, s.grad_q, s.weight_q):
        return _scaled_2d_3d(
            g, w.transpose(1, 2), offs, s, gid, ("grad_output", "weight"), out_dtype
        )
    gq = token_values(s.grad_q, g, TokenGroups(gid, w.shape[0]))
    wq = weight_values(s.weight_q, w, along_n=True)
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
    on_hardware = _hardware(s, g.device.type, s.grad_q, s.input_q)
    if on_hardware:
        block = 16  # the kernel's K alignment: each group's tokens a multiple of 16
    gp, offs_p, gid_p = pad_groups(g, offs, gid, block)
    xp, _, _ = pad_groups(x, offs, gid, block)
    if on_hardware:
        return _scaled_2d_2d(gp, xp, offs_p, s, gid_p, experts, out_dtype)
    groups = TokenGroups(gid_p, experts, block)
    gq = token_values(s.grad_q, gp, groups, columnwise=True)
    xq = token_values(s.input_q, xp, groups, columnwise=True)
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
    a_q = quantize_groups(s.quantizer(roles[0]), a, TokenGroups(gid, experts))
    b_rows = TokenGroups.uniform(experts, n, b.device)
    b_q = quantize_groups(s.quantizer(roles[1]), b.reshape(experts * n, k), b_rows)
    b_codes = b_q.data.reshape(experts, n, k).transpose(1, 2)  # column-major [E, K, N]
    return (
        a_q.data.contiguous(),
        b_codes,
        a_q.scale_inv.reshape(-1).contiguous(),
        b_q.scale_inv.reshape(experts, n).contiguous(),
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
    groups = TokenGroups(gid_p, experts)
    codes, scales = [], []
    for m, role in ((gp, "grad_output"), (xp, "input")):
        q = quantize_groups(s.quantizer(role), m, groups, columnwise=True)
        codes.append(q.data)
        scales.append(_per_group(q.scale_inv, gid_p, experts, m.shape[1]))
    a = codes[0].t().contiguous()  # row-major [N, Tp]
    b = codes[1].t().contiguous().t()  # column-major [Tp, K]
    return a, b, scales[0], scales[1]


def _per_group(scale_inv: torch.Tensor, gid: torch.Tensor, experts: int, cols: int) -> torch.Tensor:
    """A quantizer's per-row or per-element scales (one value in each group, per feature)
    as the kernel reads them: ``[experts * cols]``; an empty group's scale is 1."""
    out = torch.ones(experts, scale_inv.shape[1], dtype=torch.float32, device=scale_inv.device)
    index = gid.unsqueeze(1).expand(scale_inv.shape)
    out.scatter_reduce_(0, index, scale_inv.float(), "amax", include_self=False)
    return out.expand(experts, cols).reshape(-1).contiguous()
