"""Grouped scaled GEMMs for mixture-of-experts layers: ``x @ W[e].T`` for each expert's
token group, and their two backward GEMMs, with every recipe's scaling.

Layout (that of ``torch._grouped_mm``): the tokens ``x`` ``[T, K]`` are sorted by
expert; ``offs`` ``[E]`` (int32, on the tokens' device) holds the cumulative end of
each expert's group; the experts' weights are one ``[E, N, K]`` tensor. Group sizes
never leave the device: every per-group quantity (a group's scale, the group of a
token, the padding of a group to a block multiple) is computed with device-side index
arithmetic (``searchsorted``, ``scatter_reduce``, ``index_copy``), so fastcast's own
operations make no device-to-host synchronisation and compile with ``fullgraph=True``.
(On a GPU the emulated GEMMs still sync: torch's CUDA ``_grouped_mm`` takes FP32 only
on its fallback, which reads ``offs`` back to the host. Only the GEMMs on
``torch._scaled_grouped_mm`` are free of it; docs/cuda.md.)

Quantization: the recipe's scheme gives the quantizers (``Scheme.grouped_quantizers``),
and each quantizes every token group, and every expert's weight, as a tensor of its own
(``quantizers.groups.quantize_groups``): scales that span the tokens (per-tensor,
NVFP4's tensor scale) are per group, and the weight-gradient operands, whose blocks run
along the tokens, have each group padded with zero rows to the block multiple (at
device-computed positions, into a buffer of a size known from the shapes alone: ``T +
E * (block - 1)``), so that no block spans two experts.

Backends, chosen by capability as for the dense GEMMs (``hardware.grouped_gemm_backend``):
``torch._scaled_grouped_mm`` on CUDA GPUs that have it (sm90, sm100) for the per-tensor
and row-wise families with E4M3 operands (other families and E5M2 operands emulate);
elsewhere (the CPU) the emulation: each operand quantized and dequantized in one pass
(the codes the hardware would read, times their scales, in FP32) and multiplied by
``torch._grouped_mm`` in FP32 (FP32 accumulation, as the tensor cores).

Here: ``grouped_mm`` and its autograd Function; ``scaling.py`` (what the scheme says of
a recipe), ``emulation.py`` (the emulated operands) and ``gemms.py`` (the three GEMMs,
on the hardware or emulated).
"""

from __future__ import annotations

from typing import Any

import torch

from ..recipe import Recipe
from ..token_groups import TokenGroups, group_amax, group_ids, pad_groups, padded_rows
from .emulation import token_values, weight_values
from .gemms import grouped_dgrad, grouped_forward, grouped_wgrad, operands_2d_2d, operands_2d_3d
from .scaling import GroupedScaling, grouped_scaling

__all__ = [
    "GroupedGemm",
    "GroupedScaling",
    "TokenGroups",
    "group_amax",
    "group_ids",
    "grouped_dgrad",
    "grouped_forward",
    "grouped_gemm",
    "grouped_mm",
    "grouped_scaling",
    "grouped_wgrad",
    "operands_2d_2d",
    "operands_2d_3d",
    "output_dtype",
    "pad_groups",
    "padded_rows",
    "token_values",
    "weight_values",
]


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
        ctx.scaling = s
        if x.shape[0] == 0:  # no tokens: an empty output, zero gradients
            ctx.save_for_backward(x, w)
            return x.new_zeros(0, w.shape[1], dtype=output_dtype(x))
        x = ignore_rows_past_end(x, offs)
        gid = group_ids(offs, x.shape[0])
        out = grouped_forward(x, w, offs, s, gid, output_dtype(x))
        ctx.save_for_backward(x, w, offs, gid)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors  # (read once: checkpointing allows one unpack)
        if len(saved) == 2:
            x, w = saved
            return torch.zeros_like(x), torch.zeros_like(w), None, None
        x, w, offs, gid = saved
        s = ctx.scaling
        grad = ignore_rows_past_end(grad, offs)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # (The grouped GEMMs leave rows past the end unwritten: zero, not garbage,
            # flows back to whatever produced them.)
            dx = ignore_rows_past_end(grouped_dgrad(grad, w, offs, s, gid, x.dtype), offs)
        if ctx.needs_input_grad[1]:
            dw = grouped_wgrad(grad, x, offs, s, gid, w.shape[0], w.dtype)
        return dx, dw, None, None


def ignore_rows_past_end(m: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``m`` with the rows past the last group's end zeroed, as ``torch._grouped_mm``
    ignores them: they must reach no group's scale, product or weight gradient. (Their
    count is on the device: a masked copy, not a slice, keeps it there.)"""
    past_end = torch.arange(m.shape[0], device=m.device) >= offs[-1]
    return m.masked_fill(past_end.unsqueeze(1), 0)


def grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, recipe: Recipe
) -> torch.Tensor:
    """``x[t] @ weight[e].T`` for the tokens ``t`` of group ``e`` (``offs``: int32
    cumulative group ends, on ``x``'s device), quantized as ``recipe`` says, differentiable
    in ``x`` and ``weight``. Rows past ``offs[-1]`` are left unspecified, as in
    ``torch._grouped_mm``."""
    return grouped_gemm(x, weight, offs, grouped_scaling(recipe))


def grouped_gemm(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, s: GroupedScaling
) -> torch.Tensor:
    """``grouped_mm`` under the recipe's ``grouped_scaling``, which a module keeps."""
    _check(x, weight, offs)
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
    _check_offsets(offs, x.shape[0])


def _check_offsets(offs: torch.Tensor, tokens: int) -> None:
    """The group ends must be non-decreasing and within ``[0, tokens]``. An assertion
    that runs where the ends are, never a read back to the host (on a GPU that would stall
    its queue every call): on the CPU it raises here, as a ValueError naming the ends; on
    a GPU it fails the device's queue (a device-side assert), as an index out of range
    would."""
    if offs.numel() == 0:
        return
    ok = (offs[0] >= 0) & (offs[-1] <= tokens) & (torch.diff(offs) >= 0).all()
    message = (
        f"grouped GEMM: offs must be non-decreasing group ends within [0, T={tokens}] "
        "(cumulative token counts per expert)"
    )
    if not offs.is_cpu or torch.compiler.is_compiling():
        torch._assert_async(ok, message)
        return
    try:
        torch._assert_async(ok, message)
    except RuntimeError:
        raise ValueError(f"{message}, got {offs.tolist()}") from None
