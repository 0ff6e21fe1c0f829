"""Which GEMM path each recipe's GEMMs should take on a GPU: the table the fake-CUDA
tests assert and docs/cuda.md shows (``python tests/cuda/gemm_matrix.py`` prints it).

Written from what torch's kernels accept (``aten/src/ATen/native/cuda/ScaledBlas.cpp``,
``GroupedBlas.cpp`` and their meta checks), not read from fastcast's code:

- ``torch._scaled_mm``, per-tensor FP32 scales: sm89+, K and N multiples of 16, not E5M2
  x E5M2, any float output;
- ``torch._scaled_mm``, per-row scales: CUTLASS's kernel (E4M3 b, bf16 output) on sm89+;
  cuBLAS 12.9+ on sm90 writes any float output;
- ``F.scaled_mm`` 1x128 x 128x128 / 1x128 x 1x128: cuBLASLt 12.9+ on sm90 only; bf16
  output; whole 128-element tiles (K; a 128x128 operand's rows), tokens a multiple of 16;
- ``F.scaled_mm`` MXFP8 (E8M0 scales, 1x32) and NVFP4 (E4M3 1x16 scales and an FP32
  tensor scale): sm100 only; swizzled scales; bf16 output (fastcast asks no other);
- the block-scaled kernels get no bias or accumulation from fastcast (it would need
  their FP32 product): such products are emulated;
- ``torch._scaled_grouped_mm``: sm90 and sm100, E4M3 x E4M3, per-tensor or per-row FP32
  scales, bf16 output. Everything else grouped is emulated in FP32 through
  ``torch._grouped_mm``, whose CUDA kernel takes FP32 only on its fallback, which reads
  the group ends back to the host (``offs.cpu()``): a host sync per emulated grouped GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import fastcast as fc

SM89, SM90, SM100 = (8, 9), (9, 0), (10, 0)
CAPABILITIES = {"sm89": SM89, "sm90": SM90, "sm100": SM100}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RECIPES = {
    "delayed": fc.DelayedScaling(amax_history_len=4),
    "current": fc.Float8CurrentScaling(),
    "rowwise": fc.Float8RowwiseScaling(),
    "rowwise_hp_wgrad": fc.Float8RowwiseScaling(wgrad_high_precision=True),
    "block": fc.Float8BlockScaling(),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(),
}
FAMILY = {
    "delayed": "tensorwise",
    "current": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_hp_wgrad": "rowwise",
    "block": "blockwise",
    "mxfp8": "mxfp8",
    "nvfp4": "nvfp4",
}
# Element formats (input, weight, gradient) of each recipe's defaults.
FORMATS = {
    "delayed": ("e4m3", "e4m3", "e5m2"),
    "current": ("e4m3", "e4m3", "e5m2"),
    "rowwise": ("e4m3", "e4m3", "e4m3"),
    "rowwise_hp_wgrad": ("e4m3", "e4m3", "e4m3"),
    "block": ("e4m3", "e4m3", "e4m3"),
    "mxfp8": ("e4m3", "e4m3", "e4m3"),
    "nvfp4": ("e2m1", "e2m1", "e2m1"),
}
# What each path is called in the table.
SCALED_MM, BLOCK_MM, GROUPED_MM, EMULATED, HIGH = (
    "torch._scaled_mm",
    "F.scaled_mm",
    "torch._scaled_grouped_mm",
    "emulated",
    "high precision",
)


@dataclass(frozen=True)
class Gemm:
    """One scaled GEMM ``a @ b.T``: ``a`` ``[m, k]``, ``b`` ``[n, k]``; ``b_rows_tile``:
    whether b is a 128x128-tiled weight (its rows must be whole tiles)."""

    m: int
    k: int
    n: int
    fmts: tuple[str, str]
    bias: bool = False
    b_tiled: bool = False


def dense_path(family: str, cap: tuple[int, int], out: torch.dtype, g: Gemm) -> str:
    """The path of one dense GEMM (CUDA 12.9, torch with ``F.scaled_mm``)."""
    if cap < SM89 or g.k % 16 or g.n % 16 or g.fmts == ("e5m2", "e5m2"):
        return EMULATED
    if family == "tensorwise":
        return SCALED_MM
    if family == "rowwise":
        ok = g.fmts[1] == "e4m3" and (out == torch.bfloat16 or cap == SM90)
        return SCALED_MM if ok else EMULATED
    block_kernel_ok = out == torch.bfloat16 and not g.bias
    if family == "blockwise":
        tiles = g.k % 128 == 0 and g.m % 16 == 0 and (not g.b_tiled or g.n % 128 == 0)
        return BLOCK_MM if cap == SM90 and block_kernel_ok and tiles else EMULATED
    if family in ("mxfp8", "nvfp4"):
        k_ok = g.k % 32 == 0  # MXFP8's blocks; NVFP4's K/2 bytes a multiple of 16
        return BLOCK_MM if cap == SM100 and block_kernel_ok and k_ok else EMULATED
    raise ValueError(family)


def linear_gemms(name: str, tokens: int, k: int, n: int, bias: bool) -> dict[str, Gemm | None]:
    """fc.Linear's three GEMMs (None: not a scaled GEMM) for ``x [tokens, k]``, weight
    ``[n, k]``: forward ``x @ w.T``, dgrad ``g @ w``, wgrad ``g.T @ x``."""
    fi, fw, fg = FORMATS[name]
    tiled = name == "block"  # Float8BlockScaling's weights: 128x128 tiles
    return {
        "forward": Gemm(tokens, k, n, (fi, fw), bias=bias, b_tiled=tiled),
        "dgrad": Gemm(tokens, n, k, (fg, fw), b_tiled=tiled),
        "wgrad": None if name == "rowwise_hp_wgrad" else Gemm(n, tokens, k, (fg, fi)),
    }


def linear_paths(
    name: str, cap: tuple[int, int], dtype: torch.dtype, tokens: int, k: int, n: int, bias: bool
) -> dict[str, str]:
    """The path of each of fc.Linear's GEMMs (the layer's output dtype ``dtype``)."""
    return {
        gemm: HIGH if g is None else dense_path(FAMILY[name], cap, dtype, g)
        for gemm, g in linear_gemms(name, tokens, k, n, bias).items()
    }


def grouped_paths(name: str, cap: tuple[int, int]) -> dict[str, str]:
    """The path of each grouped GEMM of the experts (tokens x experts forward and dgrad,
    the weight gradient grouped along the tokens)."""
    fi, fw, fg = FORMATS[name]
    kernel = cap in (SM90, SM100) and FAMILY[name] in ("tensorwise", "rowwise")
    hp_wgrad = name == "rowwise_hp_wgrad"
    # (With a high-precision wgrad fastcast keeps one per-tensor weight scale along N for
    # the dgrad and emulates it: a choice of fastcast's, not a kernel limit.)
    return {
        "forward": GROUPED_MM if kernel and (fi, fw) == ("e4m3", "e4m3") else EMULATED,
        "dgrad": GROUPED_MM if kernel and not hp_wgrad and fg == fw == "e4m3" else EMULATED,
        "wgrad": HIGH if hp_wgrad else GROUPED_MM if kernel and fg == fi == "e4m3" else EMULATED,
    }


# The layers of the fake-CUDA tests: test_fake_cuda's (a bias, 64 tokens: half a 128
# tile) and one of whole tiles without a bias.
LAYER = {"tokens": 64, "k": 128, "n": 256, "bias": True}
WHOLE_TILES = {"tokens": 256, "k": 128, "n": 384, "bias": False}


def render_markdown() -> str:
    """The docs table: per recipe and capability, the path of each GEMM (forward / dgrad
    / wgrad) of ``LAYER`` in bf16 and FP32, of ``WHOLE_TILES`` in bf16, and of the
    grouped experts."""
    short = {
        SCALED_MM: "`_scaled_mm`",
        BLOCK_MM: "**`F.scaled_mm`**",
        GROUPED_MM: "`_scaled_grouped_mm`",
    }

    def cell(paths: dict[str, str]) -> str:
        return " / ".join(short.get(p, p) for p in paths.values())

    lines = [
        "| recipe | GPU | `fc.Linear`, bias, bf16 | same, fp32 | bias-free whole tiles, bf16 "
        "| grouped experts |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in RECIPES:
        for cap_name, cap in CAPABILITIES.items():
            cells = [
                cell(linear_paths(name, cap, torch.bfloat16, **LAYER)),
                cell(linear_paths(name, cap, torch.float32, **LAYER)),
                cell(linear_paths(name, cap, torch.bfloat16, **WHOLE_TILES)),
                cell(grouped_paths(name, cap)),
            ]
            lines.append(f"| {name} | {cap_name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


DOCS_MARKERS = ("<!-- gemm-matrix -->\n", "<!-- /gemm-matrix -->")


def with_table(text: str) -> str:
    """``text`` (docs/cuda.md) with the table between its markers replaced by
    ``render_markdown()``."""
    start, end = DOCS_MARKERS
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + render_markdown() + end + tail


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:] == ["--write"]:  # docs/cuda.md's copy, rewritten
        docs = Path(__file__).parents[2] / "docs" / "cuda.md"
        docs.write_text(with_table(docs.read_text()))
    else:
        print(render_markdown(), end="")
