"""The block-scaled and grouped GEMM paths on a real GPU (``pytest -m gpu``; skipped
without one): the path each GEMM takes on this device against ``gemm_matrix`` (the
table of docs/cuda.md), and every kernel's product against the emulation and the
float64 product of the dequantized operands, within the K-term accumulation bound of
``test_gpu._assert_tensor_core_close``. The MXFP8 / NVFP4 products run on sm100 only.
"""

from __future__ import annotations

import pytest
import torch
from fake_cuda import Launches, _Recorder
from gemm_matrix import (
    BLOCK_MM,
    CAPABILITIES,
    EMULATED,
    FAMILY,
    GROUPED_MM,
    HIGH,
    RECIPES,
    SCALED_MM,
    WHOLE_TILES,
    grouped_paths,
    linear_paths,
)
from test_gpu import _assert_tensor_core_close, _reference

import fastcast as fc
from fastcast.runtime import hardware

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def _in_table() -> bool:
    return _capability() in CAPABILITIES.values() and torch.version.cuda is not None


needs_sm100 = pytest.mark.skipif(
    not torch.cuda.is_available() or not hardware.has_kernel("cuda", "mxfp8"),
    reason="needs sm100 with torch 2.10+ (F.scaled_mm) and CUDA 12.8+",
)
needs_table_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not _in_table(), reason="needs an sm89, sm90 or sm100 GPU"
)


def _operands(recipe, m: int, k: int, n: int):
    torch.manual_seed(m + 3 * k + 7 * n)
    x = fc.quantize(torch.randn(m, k, device="cuda"), recipe, "input", columnwise=True)
    w = fc.quantize(torch.randn(n, k, device="cuda") / 8, recipe, "weight", columnwise=True)
    g = fc.quantize(torch.randn(m, n, device="cuda"), recipe, "grad_output", columnwise=True)
    return {
        "forward": (x, w),
        "dgrad": (g, w.t()),
        "wgrad": (g.columnwise_operand(), x.columnwise_operand()),
    }


@needs_sm100
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (96, 256, 128)])
def test_microscaled_gemms_on_tensor_cores(name, m, k, n):
    """MXFP8 / NVFP4 forward, dgrad and wgrad on sm100's block-scaled kernel (swizzled
    scales): equal to the emulation and the float64 product, to the accumulation bound."""
    recipe = RECIPES[name]
    for gemm, (a, b) in _operands(recipe, m, k, n).items():
        ref = _reference(a, b)
        hw = fc.scaled_mm(a, b, out_dtype=torch.bfloat16, backend="hardware")
        em = fc.scaled_mm(a, b, out_dtype=torch.bfloat16, backend="emulate")
        assert hw.dtype == torch.bfloat16, gemm
        _assert_tensor_core_close(hw, a, b, ref)
        scale = ref.abs().max().item()
        torch.testing.assert_close(em.double(), ref, rtol=2.0**-7, atol=2.0**-7 * scale)


@needs_sm100
def test_microscaled_rows_off_the_scale_tile_and_leading_dims():
    """33 rows (scales padded to 128) and a 3-D activation: the kernel's padding rows
    change nothing."""
    recipe = RECIPES["mxfp8"]
    torch.manual_seed(9)
    x = fc.quantize(torch.randn(3, 11, 256, device="cuda"), recipe, "input")
    w = fc.quantize(torch.randn(64, 256, device="cuda"), recipe, "weight")
    hw = fc.scaled_mm(x, w, out_dtype=torch.bfloat16, backend="hardware")
    assert hw.shape == (3, 11, 64)
    _assert_tensor_core_close(hw.reshape(33, 64), x, w, _reference(x, w))


def _record(step) -> Launches:
    launched = Launches()
    with _Recorder(launched):
        step()
    return launched


@needs_table_gpu
@pytest.mark.parametrize("name", list(RECIPES))
def test_layer_paths_on_this_gpu(name):
    """A bias-free bf16 layer of whole tiles: the GEMMs that run on a kernel are those
    the table gives for this GPU's capability."""
    missing = hardware.block_gemm_missing(FAMILY[name])
    if missing is not None and name in ("block", "mxfp8", "nvfp4"):
        pytest.skip(missing)  # (the table is that of a torch with F.scaled_mm)
    tokens, k, n = WHOLE_TILES["tokens"], WHOLE_TILES["k"], WHOLE_TILES["n"]
    torch.manual_seed(0)
    layer = fc.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        with fc.autocast(recipe=RECIPES[name]):
            y = layer(x)
        y.float().square().mean().backward()

    launched = _record(step)
    expected = linear_paths(name, _capability(), torch.bfloat16, **WHOLE_TILES)
    kinds = sorted(BLOCK_MM if "recipes" in c else SCALED_MM for c in launched.scaled_mm)
    assert kinds == sorted(p for p in expected.values() if p in (SCALED_MM, BLOCK_MM))
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()


@needs_table_gpu
@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_linear_paths_and_values_on_this_gpu(name, gemm_mode):
    """fc.GroupedLinear (4 groups, bf16): the grouped GEMMs on
    ``torch._scaled_grouped_mm`` as the table says; forward and gradients near the
    emulated run's (FP8 grouped kernels write bf16)."""
    torch.manual_seed(1)
    layer = fc.GroupedLinear(4, 128, 256, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([16, 48, 48, 96], device="cuda", dtype=torch.int32)

    def run():
        torch.manual_seed(2)  # (NVFP4's stochastic rounding: the same draws in both runs)
        layer.weight.grad = None
        x = x0.clone().requires_grad_(True)
        with fc.autocast(recipe=RECIPES[name]):
            y = layer(x, offs)
        y.float().square().mean().backward()
        return y.float(), x.grad.float(), layer.weight.grad.float()

    launched = Launches()
    with _Recorder(launched):
        got = run()
    expected = grouped_paths(name, _capability())
    kernels = sum(p == GROUPED_MM for p in expected.values())
    assert len(launched.scaled_grouped_mm) == kernels
    fp32 = [d for d in launched.grouped_mm if d == torch.float32]
    assert len(fp32) == sum(p in (EMULATED, HIGH) for p in expected.values())
    gemm_mode("emulate")
    want = run()
    for g, w in zip(got, want):
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < 0.02, rel
