"""The emulation's operands: each operand quantized and dequantized in one pass.

What the hardware would read (the codes, times their scales) in FP32, per family:
``quantize_rows`` along the contraction dim of the forward and dgrad operands,
``quantize_columns`` along the tokens within each group (the weight-gradient operands,
padded by ``groups.pad_groups``), ``quantize_weight`` per expert.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..formats import ELEMENT_MAX
from ..reference import hadamard
from ..reference.cast import scale_and_cast, scale_from_amax
from ..reference.mx import MX_BLOCK, power_of_2, shared_exponent
from ..reference.nvfp4 import BLOCK as NVFP4_BLOCK
from ..reference.nvfp4 import encode_blocks as nvfp4_encode
from ..reference.rows import row_amax
from ..tensor import BLOCKWISE, MXFP8, NVFP4, ROWWISE, TENSORWISE
from .groups import group_amax
from .scaling import BLOCK_TILE, GroupedScaling

E4M3_MAX = ELEMENT_MAX["e4m3"]
E2M1_MAX = ELEMENT_MAX["e2m1"]


def _finite_abs(m: torch.Tensor) -> torch.Tensor:
    return m.float().abs().nan_to_num_(nan=0.0, posinf=0.0)


def _fp8(v: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 codes of ``v * scale`` times ``1 / scale``: what the GEMM reads, in FP32."""
    return scale_and_cast(v, scale, fmt).float().mul_(scale.reciprocal())


def _mx(blocks: torch.Tensor, dim: int, fmt: str) -> torch.Tensor:
    """MXFP8 over blocks that run along ``dim`` (``rceil``, fastcast's MX rule)."""
    amax = _finite_abs(blocks).amax(dim=dim, keepdim=True)
    x = shared_exponent(amax, fmt, "rceil")
    return scale_and_cast(blocks, power_of_2(-x), fmt).float().mul_(power_of_2(x))


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Signed E2M1 codes (uint8) as FP32: 0, .5, 1, 1.5 below code 4, then 2, 3, 4, 6."""
    c = codes.to(torch.int32)
    mag = c & 7
    low = mag.float() * 0.5
    high = torch.ldexp((1 + 0.5 * (mag & 1).float()), (mag >> 1) - 1)
    value = torch.where(mag < 4, low, high)
    return torch.where(c >= 8, -value, value)


def _nvfp4(blocks: torch.Tensor, s_enc: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """NVFP4 of ``blocks`` ``[r, tr, c, 16]`` (FP32) whose FP32 encode scale ``s_enc``
    broadcasts to the block grid ``[r, c]``; returns the dequantized blocks."""
    mag = blocks.abs()
    block_amax = mag.amax(dim=(1, 3))
    draw = torch.rand(blocks.shape, device=blocks.device) if stochastic else None
    codes, s_dec = nvfp4_encode(blocks, mag, block_amax, s_enc, draw)
    decode = s_dec.float().mul_(s_enc.reciprocal())
    return _e2m1_values(codes).mul_(decode[:, None, :, None])


def _s_enc(amax: torch.Tensor) -> torch.Tensor:
    return scale_from_amax(amax, E2M1_MAX * E4M3_MAX)


def quantize_rows(
    m: torch.Tensor, s: GroupedScaling, role: str, gid: torch.Tensor, groups: int
) -> torch.Tensor:
    """``m`` ``[R, D]`` quantized along D (the forward and dgrad operands), rows of group
    ``gid`` sharing their group's per-tensor scales; dequantized to FP32."""
    fmt = s.fmt(role)
    rows, cols = m.shape
    family = s.family
    if family == TENSORWISE:
        group = group_amax(row_amax(m, 1).squeeze(1), gid, groups)
        scale = scale_from_amax(
            group, ELEMENT_MAX[fmt], margin=s.margin, power_2=s.power_2, epsilon=s.epsilon
        )
        return _fp8(m, scale[gid].unsqueeze(1), fmt)
    if family == ROWWISE:
        scale = scale_from_amax(row_amax(m, 1), ELEMENT_MAX[fmt], power_2=s.power_2)
        return _fp8(m, scale, fmt)
    if family == BLOCKWISE:
        pad = -cols % BLOCK_TILE  # a partial block is scaled from its own elements
        mp = torch.nn.functional.pad(m, (0, pad)) if pad else m
        blocks = mp.reshape(rows, -1, BLOCK_TILE)
        amax = torch.linalg.vector_norm(
            blocks, ord=math.inf, dim=2, keepdim=True, dtype=torch.float32
        )
        scale = scale_from_amax(amax, ELEMENT_MAX[fmt], power_2=s.power_2)
        out = _fp8(blocks, scale, fmt).reshape(rows, cols + pad)
        return out[:, :cols] if pad else out
    if family == MXFP8:
        return _mx(m.reshape(rows, cols // MX_BLOCK, MX_BLOCK), 2, fmt).reshape(rows, cols)
    # NVFP4, 1x16 blocks along D; the tensor scale is per group.
    v = m.float()
    s_enc = _s_enc(group_amax(_finite_abs(v).amax(dim=1), gid, groups))
    blocks = v.reshape(rows, 1, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    stochastic = role == "grad_output" and s.stochastic_grad
    return _nvfp4(blocks, s_enc[gid].unsqueeze(1), stochastic).reshape(rows, cols)


def quantize_columns(
    mp: torch.Tensor, s: GroupedScaling, role: str, gid: torch.Tensor, groups: int
) -> torch.Tensor:
    """The padded tokens ``mp`` ``[Tp, D]`` (``pad_groups`` to ``s.block``) quantized
    along the tokens, within each group (the weight-gradient operands); FP32. With NVFP4's
    Hadamard transform, the transformed tokens (the product of two transformed operands
    is unchanged)."""
    fmt = s.fmt(role)
    rows, cols = mp.shape
    family = s.family
    if family == TENSORWISE:  # the group's scale is the same in both orientations
        return quantize_rows(mp, s, role, gid, groups)
    if family == ROWWISE:  # one scale per (group, feature)
        amax = torch.zeros(groups, cols, dtype=torch.float32, device=mp.device)
        index = gid.unsqueeze(1).expand(rows, cols)
        amax.scatter_reduce_(0, index, mp.float().abs(), "amax", include_self=True)
        scale = scale_from_amax(amax, ELEMENT_MAX[fmt], power_2=s.power_2)
        return _fp8(mp, scale[gid], fmt)
    if family == BLOCKWISE:
        blocks = mp.reshape(rows // BLOCK_TILE, BLOCK_TILE, cols)
        amax = torch.linalg.vector_norm(
            blocks, ord=math.inf, dim=1, keepdim=True, dtype=torch.float32
        )
        scale = scale_from_amax(amax, ELEMENT_MAX[fmt], power_2=s.power_2)
        return _fp8(blocks, scale, fmt).reshape(rows, cols)
    if family == MXFP8:
        return _mx(mp.reshape(rows // MX_BLOCK, MX_BLOCK, cols), 1, fmt).reshape(rows, cols)
    # NVFP4: 16-token blocks, each inside one group (the padding saw to it).
    v = hadamard.transform_columns(mp, s.rht) if s.rht is not None else mp.float()
    s_enc = _s_enc(group_amax(_finite_abs(v).amax(dim=1), gid, groups))
    vt = v.t().contiguous()  # [D, Tp]: blocks along the tokens
    blocks = vt.reshape(cols, 1, rows // NVFP4_BLOCK, NVFP4_BLOCK)
    block_s_enc = s_enc[gid[::NVFP4_BLOCK]].unsqueeze(0)  # [1, Tp/16]
    stochastic = role == "grad_output" and s.stochastic_grad
    return _nvfp4(blocks, block_s_enc, stochastic).reshape(cols, rows).t()


def quantize_weight(w: torch.Tensor, s: GroupedScaling, along_n: bool = False) -> torch.Tensor:
    """The experts' weights ``[E, N, K]`` quantized per expert along K (the forward
    operand) or, with ``along_n``, along N (the dgrad operand); FP32 ``[E, N, K]``."""
    experts, n, k = w.shape
    if s.weight_tile > 1:  # 2-D tiles: one quantization serves both GEMMs
        return _quantize_tiles(w, s)
    if s.wgrad_high_precision and along_n:  # torchao's rowwise_with_gw_hp: per tensor
        s = dataclasses.replace(s, family=TENSORWISE)
    m = w.transpose(1, 2) if along_n else w
    rows, cols = m.shape[1], m.shape[2]
    gid = torch.arange(experts, device=w.device).repeat_interleave(rows)
    q = quantize_rows(m.reshape(experts * rows, cols), s, "weight", gid, experts)
    q = q.reshape(experts, rows, cols)
    return q.transpose(1, 2) if along_n else q


def _quantize_tiles(w: torch.Tensor, s: GroupedScaling) -> torch.Tensor:
    """``w`` ``[E, N, K]`` in square tiles per expert (128x128 FP8, 16x16 NVFP4); edge
    tiles are zero-padded, which changes no amax."""
    experts, n, k = w.shape
    t = s.weight_tile
    pad_n, pad_k = -n % t, -k % t
    wp = torch.nn.functional.pad(w.float(), (0, pad_k, 0, pad_n)) if pad_n or pad_k else w.float()
    tn, tk = (n + pad_n) // t, (k + pad_k) // t
    if s.family == NVFP4:
        blocks = wp.reshape(experts * tn, t, tk, t)
        s_enc = _s_enc(_finite_abs(w).amax(dim=(1, 2)))  # per expert
        out = _nvfp4(blocks, s_enc.repeat_interleave(tn).unsqueeze(1), False)
    else:
        fmt = s.fmt_weight
        tiles = wp.reshape(experts, tn, t, tk, t)
        amax = torch.linalg.vector_norm(tiles, ord=math.inf, dim=(2, 4), keepdim=True)
        scale = scale_from_amax(amax, ELEMENT_MAX[fmt], power_2=s.power_2)
        out = _fp8(tiles, scale, fmt)
    out = out.reshape(experts, n + pad_n, k + pad_k)
    return out[:, :n, :k] if pad_n or pad_k else out
