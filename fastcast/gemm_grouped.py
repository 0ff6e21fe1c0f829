"""Grouped scaled GEMMs for mixture-of-experts layers: ``x @ W[e].T`` for each expert's
token group, and their two backward GEMMs, with every recipe's scaling.

Layout (that of ``torch._grouped_mm``): the tokens ``x`` ``[T, K]`` are sorted by
expert; ``offs`` ``[E]`` (int32, on the tokens' device) holds the cumulative end of
each expert's group; the experts' weights are one ``[E, N, K]`` tensor. Group sizes
never leave the device: every per-group quantity (a group's scale, the group of a
token, the padding of a group to a block multiple) is computed with device-side index
arithmetic (``searchsorted``, ``scatter_reduce``, ``index_copy``), so a forward and
backward make no device-to-host synchronisation, can be captured in a CUDA graph and
compile with ``fullgraph=True``.

Scaling, per recipe family (the contraction dim of each GEMM is the one blocks run
along, as for the dense GEMMs):

- per-tensor (``Float8CurrentScaling``; ``DelayedScaling`` too, see ``grouped_scaling``):
  one scale per expert's weight and one per token group;
- row-wise: per token (forward, dgrad), per expert row / column of the weight, per
  (group, feature) for the weight-gradient operands, which contract over the tokens;
- 1x128 / 128x128 blocks, MXFP8 (1x32, E8M0), NVFP4 (1x16 or 16x16, E4M3 block scales
  and an FP32 scale per expert / per token group): blocks along K; the weight-gradient
  operands have blocks along the tokens, so each group is padded with zero rows to the
  block multiple (at device-computed positions, into a buffer of a size known from the
  shapes alone: ``T + E * (block - 1)``), so that no block spans two experts.

Backends, chosen by capability as for the dense GEMMs (``hardware.grouped_gemm_backend``):
``torch._scaled_grouped_mm`` on CUDA GPUs that have it (sm90, sm100) for the per-tensor
and row-wise families with E4M3 operands (other families and E5M2 operands emulate);
elsewhere (the CPU) the emulation: each operand quantized and dequantized in one pass
(the codes the hardware would read, times their scales, in FP32) and multiplied by
``torch._grouped_mm`` in FP32 (FP32 accumulation, as the tensor cores).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .formats import ELEMENT_MAX
from .recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from .reference import hadamard
from .reference.cast import scale_and_cast, scale_from_amax
from .reference.mx import MX_BLOCK, power_of_2, shared_exponent
from .reference.nvfp4 import BLOCK as NVFP4_BLOCK
from .reference.nvfp4 import encode_blocks as nvfp4_encode
from .reference.rows import row_amax
from .runtime import hardware
from .tensor import BLOCKWISE, MXFP8, NVFP4, ROWWISE, TENSORWISE

BLOCK_TILE = 128  # Float8BlockScaling's block extent
E4M3_MAX = ELEMENT_MAX["e4m3"]
E2M1_MAX = ELEMENT_MAX["e2m1"]


@dataclasses.dataclass(frozen=True)
class GroupedScaling:
    """What one recipe means for the grouped GEMM (``grouped_scaling`` builds it)."""

    family: str
    fmt_input: str
    fmt_weight: str
    fmt_grad: str
    power_2: bool = False
    epsilon: float = 0.0
    margin: int = 0
    # Weight tile extent along N as well as K (128x128 blocks, NVFP4 16x16); 1: 1-D blocks.
    weight_tile: int = 1
    stochastic_grad: bool = False
    rht: tuple[int, ...] | None = None
    wgrad_high_precision: bool = False

    def fmt(self, role: str) -> str:
        return {"input": self.fmt_input, "weight": self.fmt_weight}.get(role, self.fmt_grad)

    @property
    def block(self) -> int:
        """The block extent along the contraction dim (1: no blocks)."""
        return {BLOCKWISE: BLOCK_TILE, MXFP8: MX_BLOCK, NVFP4: NVFP4_BLOCK}.get(self.family, 1)

    @property
    def alignment(self) -> int:
        """What the experts' in and out features must be multiples of."""
        return {MXFP8: MX_BLOCK, NVFP4: NVFP4_BLOCK}.get(self.family, 16)


def grouped_scaling(recipe: Recipe) -> GroupedScaling:
    """The grouped GEMM's meaning of ``recipe``; TypeError for recipes it cannot run.

    ``DelayedScaling`` runs as per-tensor current scaling per expert and token group
    (its format and margin; the experts keep no amax history: a history per token group
    would describe groups whose sizes change every step).
    """
    if isinstance(recipe, (Float8CurrentScaling, DelayedScaling)):
        fmt = recipe.fp8_format
        current = isinstance(recipe, Float8CurrentScaling)
        return GroupedScaling(
            TENSORWISE,
            fmt.for_role("input"),
            fmt.for_role("weight"),
            fmt.for_role("grad_output"),
            power_2=current and recipe.use_power_2_scales,
            epsilon=recipe.amax_epsilon if current else 0.0,
            margin=0 if current else recipe.margin,
        )
    if isinstance(recipe, Float8RowwiseScaling):
        fmt = recipe.fp8_format
        return GroupedScaling(
            ROWWISE,
            fmt.for_role("input"),
            fmt.for_role("weight"),
            fmt.for_role("grad_output"),
            power_2=recipe.use_power_2_scales,
            wgrad_high_precision=recipe.wgrad_high_precision,
        )
    if isinstance(recipe, Float8BlockScaling):
        if recipe.x_block_scaling_dim != 1 or recipe.grad_block_scaling_dim != 1:
            raise TypeError(
                "grouped GEMM: Float8BlockScaling needs 1x128 blocks for the input and "
                "gradient (x_block_scaling_dim=1, grad_block_scaling_dim=1); 128x128 tiles "
                "would span several experts' tokens"
            )
        fmt = recipe.fp8_format
        return GroupedScaling(
            BLOCKWISE,
            fmt.for_role("input"),
            fmt.for_role("weight"),
            fmt.for_role("grad_output"),
            power_2=not recipe.use_f32_scales,
            weight_tile=BLOCK_TILE if recipe.w_block_scaling_dim == 2 else 1,
        )
    if isinstance(recipe, MXFP8BlockScaling):
        fmt = recipe.fp8_format
        return GroupedScaling(
            MXFP8, fmt.for_role("input"), fmt.for_role("weight"), fmt.for_role("grad_output")
        )
    if isinstance(recipe, NVFP4BlockScaling):
        return GroupedScaling(
            NVFP4,
            "e2m1",
            "e2m1",
            "e2m1",
            weight_tile=NVFP4_BLOCK if recipe.weight_2d_blocks else 1,
            stochastic_grad=recipe.stochastic_rounding,
            rht=hadamard.sign_vector(recipe.rht_seed) if recipe.random_hadamard_transform else None,
        )
    raise TypeError(
        f"grouped GEMM: no grouped scaling for {type(recipe).__name__}; the experts run "
        "Float8CurrentScaling, DelayedScaling, Float8RowwiseScaling, Float8BlockScaling, "
        "MXFP8BlockScaling and NVFP4BlockScaling"
    )


# -- groups, on the device ------------------------------------------------------------------
def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group (expert) of each of ``rows`` sorted rows, int64 ``[rows]``: the first
    group whose end lies beyond the row. Rows past the last end count to the last group."""
    index = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    gid = torch.searchsorted(offs, index, right=True)
    return gid.clamp_(max=offs.shape[0] - 1)


def padded_rows(rows: int, groups: int, block: int) -> int:
    """Rows of the padded buffer: every group rounded up to ``block`` fits, whatever the
    sizes (a bound from the shapes alone, so nothing is read back from the device)."""
    return -(-(rows + groups * (block - 1)) // block) * block


def pad_groups(
    m: torch.Tensor, offs: torch.Tensor, gid: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``m`` ``[T, D]`` with each group's rows moved to a start that is a multiple of
    ``block`` and the gaps zero: ``(padded [Tp, D], padded ends [E] int32, group of each
    padded row [Tp])``. Zero rows add nothing to a product over the tokens, nor to an
    amax. Device-side only: positions come from the counts by index arithmetic."""
    if block == 1:
        return m, offs, gid
    rows, groups = m.shape[0], offs.shape[0]
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + (block - 1)).div_(block, rounding_mode="floor").mul_(block)
    ends_p = torch.cumsum(padded, 0)
    shift = (ends_p - padded) - (ends - counts)  # new start minus old start, per group
    dest = torch.arange(rows, device=m.device) + shift[gid]
    total = padded_rows(rows, groups, block)
    out = m.new_zeros(total, m.shape[1]).index_copy_(0, dest, m)
    ends_p32 = ends_p.to(torch.int32)
    return out, ends_p32, group_ids(ends_p32, total)


def _group_amax(amax: torch.Tensor, gid: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-group max of per-row amaxes (FP32 ``[groups]``; 0 for an empty group)."""
    out = torch.zeros(groups, dtype=torch.float32, device=amax.device)
    return out.scatter_reduce_(0, gid, amax, "amax", include_self=True)


def _finite_abs(m: torch.Tensor) -> torch.Tensor:
    return m.float().abs().nan_to_num_(nan=0.0, posinf=0.0)


# -- quantize + dequantize (the emulation's operands) --------------------------------------
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
        group = _group_amax(row_amax(m, 1).squeeze(1), gid, groups)
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
    s_enc = _s_enc(_group_amax(_finite_abs(v).amax(dim=1), gid, groups))
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
    s_enc = _s_enc(_group_amax(_finite_abs(v).amax(dim=1), gid, groups))
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


# -- the GEMMs --------------------------------------------------------------------------------
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
        amax = _group_amax(amax, gid, groups)[gid]
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


def output_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class GroupedGemm(torch.autograd.Function):
    """The grouped FP8/FP4 GEMM ``x @ w[e].T`` per token group and its backward GEMMs.

    Saves the high-precision input and weight (autograd holds both anyway in a MoE
    block) and quantizes their backward layouts in backward.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, s: GroupedScaling
    ) -> torch.Tensor:
        gid = group_ids(offs, x.shape[0])
        out = grouped_forward(x, w, offs, s, gid, output_dtype(x))
        ctx.save_for_backward(x, w, offs, gid)
        ctx.scaling = s
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, w, offs, gid = ctx.saved_tensors
        s = ctx.scaling
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_dgrad(grad, w, offs, s, gid, x.dtype)
        if ctx.needs_input_grad[1]:
            dw = grouped_wgrad(grad, x, offs, s, gid, w.shape[0], w.dtype)
        return dx, dw, None, None


def grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, recipe: Recipe
) -> torch.Tensor:
    """``x[t] @ weight[e].T`` for the tokens ``t`` of group ``e`` (``offs``: int32
    cumulative group ends, on ``x``'s device), quantized as ``recipe`` says, differentiable
    in ``x`` and ``weight``. Rows past ``offs[-1]`` are left unspecified, as in
    ``torch._grouped_mm``."""
    _check(x, weight, offs)
    s = grouped_scaling(recipe)
    return GroupedGemm.apply(x, weight, offs, s)


def _check(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"grouped GEMM: expects x [T, K] and weight [E, N, K], got {tuple(x.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if offs.dim() != 1 or offs.shape[0] != weight.shape[0] or offs.dtype != torch.int32:
        raise ValueError(
            f"grouped GEMM: offs must be int32 [E={weight.shape[0]}] (cumulative group ends), "
            f"got {offs.dtype} {tuple(offs.shape)}"
        )
    if offs.device != x.device:
        raise ValueError(f"grouped GEMM: offs is on {offs.device}, the tokens on {x.device}")
