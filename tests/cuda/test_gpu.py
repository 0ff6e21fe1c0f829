"""The CUDA paths: run on a machine with a GPU (``pytest -m gpu``); skipped elsewhere.

On CPU these paths cannot run, so this file is what a session with a lent GPU runs to
exercise them: torch._scaled_mm on the tensor cores against the emulation and a float64
reference, fc.Linear training on the device, and delayed scaling with device buffers.
"""

from __future__ import annotations

import pytest
import torch

import fastcast as fc
from fastcast.runtime import hardware
from fastcast.schemes import recipe_support

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _fp8_gpu() -> bool:
    cap = hardware.cuda_capability()
    return cap is not None and cap >= hardware.CUDA_FP8_CAPABILITY


needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or not _fp8_gpu(), reason="needs FP8 tensor cores (8.9+)"
)


# Hopper's FP8 tensor cores accumulate with fewer bits than FP32 (about 14 kept: the
# DeepSeek-V3 report, and the first GPU run here, where every FP32-output product missed
# a 1e-5 tolerance that the emulation meets). A product is checked against the standard
# bound for a K-term sum with that unit roundoff, |err| <= K * u * (|A| @ |B|^T), plus the
# output's rounding; a wrong scale or layout is off by O(1), far beyond it.
ACCUMULATOR_U = 2.0**-13


def _assert_tensor_core_close(out, a_q, b_q, ref, bias=None) -> None:
    a = a_q.dequantize(torch.float64).reshape(-1, a_q.shape[-1]).abs()
    b = b_q.dequantize(torch.float64).abs()
    k = a.shape[-1]
    out_u = 2.0**-8 if out.dtype == torch.bfloat16 else 2.0**-24
    bound = k * ACCUMULATOR_U * (a @ b.t()) + out_u * ref.abs() + 1e-30
    if bias is not None:  # a bias added to the rounded product rounds once more
        bound = bound + out_u * bias.double().abs()
    err = (out.double().reshape(ref.shape) - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"tensor-core product off by {worst:.2f}x its accumulation bound"


def _reference(a_q, b_q, bias=None) -> torch.Tensor:
    out = (
        a_q.dequantize(torch.float64).reshape(-1, a_q.shape[-1]) @ b_q.dequantize(torch.float64).t()
    )
    return out if bias is None else out + bias.double()


@needs_fp8
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt_a", ["e4m3", "e5m2"])
def test_tensor_core_gemm_matches_emulation_and_reference(out_dtype, fmt_a):
    from fastcast.quantizers.tensorwise import CurrentScalingQuantizer

    torch.manual_seed(0)
    a = CurrentScalingQuantizer(fmt_a).quantize(torch.randn(128, 256, device="cuda"))
    b = CurrentScalingQuantizer("e4m3").quantize(torch.randn(64, 256, device="cuda"))
    bias = torch.randn(64, device="cuda", dtype=out_dtype)
    hw = fc.scaled_mm(a, b, out_dtype=out_dtype, bias=bias, backend="hardware")
    em = fc.scaled_mm(a, b, out_dtype=out_dtype, bias=bias, backend="emulate")
    ref = _reference(a, b, bias)
    tol = 2.0**-7 if out_dtype == torch.bfloat16 else 1e-5
    scale = ref.abs().max().item()
    _assert_tensor_core_close(hw, a, b, ref, bias)
    torch.testing.assert_close(em.double(), ref, rtol=tol, atol=tol * scale)


@needs_fp8
def test_backward_layouts_on_tensor_cores():
    torch.manual_seed(1)
    recipe = fc.Float8CurrentScaling()
    g = fc.quantize(torch.randn(96, 64, device="cuda"), recipe, "grad_output", columnwise=True)
    w = fc.quantize(torch.randn(64, 128, device="cuda"), recipe, "weight", columnwise=True)
    x = fc.quantize(torch.randn(96, 128, device="cuda"), recipe, "input", columnwise=True)
    dgrad = fc.scaled_mm(g, w.t(), backend="hardware")
    wgrad = fc.scaled_mm(g.columnwise_operand(), x.columnwise_operand(), backend="hardware")
    ref_d = g.dequantize(torch.float64) @ w.dequantize(torch.float64)
    ref_w = g.dequantize(torch.float64).t() @ x.dequantize(torch.float64)
    _assert_tensor_core_close(dgrad, g, w.t(), ref_d)
    _assert_tensor_core_close(wgrad, g.columnwise_operand(), x.columnwise_operand(), ref_w)


@needs_fp8
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "recipe", [fc.Float8RowwiseScaling(), fc.Float8RowwiseScaling(fp8_format=fc.Format.HYBRID)]
)
def test_per_row_gemms_on_tensor_cores(recipe, out_dtype):
    """Forward, dgrad and wgrad operands with per-row scales: torch._scaled_mm's row-wise
    kernel where it writes ``out_dtype`` (bf16 always; FP32 with cuBLAS on sm90), the
    emulation otherwise; both match the float64 reference."""
    torch.manual_seed(3)
    x = fc.quantize(torch.randn(96, 128, device="cuda"), recipe, "input", columnwise=True)
    w = fc.quantize(torch.randn(64, 128, device="cuda"), recipe, "weight", columnwise=True)
    g = fc.quantize(torch.randn(96, 64, device="cuda"), recipe, "grad_output", columnwise=True)
    tol = 2.0**-7 if out_dtype == torch.bfloat16 else 1e-5
    for a, b in ((x, w), (g, w.t()), (g.columnwise_operand(), x.columnwise_operand())):
        ref = _reference(a, b)
        hw = fc.scaled_mm(a, b, out_dtype=out_dtype, backend="hardware")
        em = fc.scaled_mm(a, b, out_dtype=out_dtype, backend="emulate")
        assert hw.dtype == em.dtype == out_dtype
        _assert_tensor_core_close(hw, a, b, ref)
        torch.testing.assert_close(em.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.skipif(
    not torch.cuda.is_available() or not hardware.has_kernel("cuda", "blockwise"),
    reason="needs sm90 with torch 2.10+ (F.scaled_mm) and cuBLASLt 12.9+",
)
@pytest.mark.parametrize("use_f32_scales", [False, True])
def test_tile_gemms_on_tensor_cores(use_f32_scales):
    """1x128 x 128x128 (forward, dgrad) and 1x128 x 1x128 (wgrad) on cuBLASLt's kernel:
    equal to the emulation and to the float64 product of the dequantized operands, to
    bf16 rounding."""
    torch.manual_seed(4)
    recipe = fc.Float8BlockScaling(use_f32_scales=use_f32_scales)
    x = fc.quantize(torch.randn(256, 512, device="cuda"), recipe, "input", columnwise=True)
    w = fc.quantize(torch.randn(384, 512, device="cuda") / 8, recipe, "weight", columnwise=True)
    g = fc.quantize(torch.randn(256, 384, device="cuda"), recipe, "grad_output", columnwise=True)
    for a, b in ((x, w), (g, w.t()), (g.columnwise_operand(), x.columnwise_operand())):
        ref = _reference(a, b)
        hw = fc.scaled_mm(a, b, out_dtype=torch.bfloat16, backend="hardware")
        em = fc.scaled_mm(a, b, out_dtype=torch.bfloat16, backend="emulate")
        assert hw.dtype == torch.bfloat16
        scale = ref.abs().max().item()
        _assert_tensor_core_close(hw, a, b, ref)
        torch.testing.assert_close(em.double(), ref, rtol=2.0**-7, atol=2.0**-7 * scale)


@pytest.mark.parametrize(
    "recipe",
    [
        fc.DelayedScaling(),
        fc.Float8CurrentScaling(),
        fc.Float8BlockScaling(),
        fc.MXFP8BlockScaling(),
        fc.NVFP4BlockScaling(),
        fc.Float8RowwiseScaling(),
        fc.Float8RowwiseScaling(wgrad_high_precision=True),
    ],
    ids=lambda r: type(r).__name__ + ("-gw-hp" if getattr(r, "wgrad_high_precision", 0) else ""),
)
def test_linear_trains_on_the_device(recipe):
    ok, reason = recipe_support(recipe, "cuda")
    if not ok:
        pytest.skip(reason)
    torch.manual_seed(2)
    model = fc.convert(
        torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    ).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    ref.load_state_dict(model.state_dict(), strict=False)
    ref.cuda()
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with fc.autocast(recipe=recipe):
            y = model(x)
        y_ref = ref(x)
    assert y.dtype == torch.bfloat16 and y.device.type == "cuda"
    y.float().pow(2).mean().backward()
    rel = (y.float() - y_ref.float()).norm() / y_ref.float().norm()
    assert rel < 0.3
    for p in model.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
    if isinstance(recipe, fc.DelayedScaling):
        meta = model[0]._scheme_state[0]
        assert meta.scale.device.type == "cuda"
        assert not torch.equal(meta.scale, torch.ones_like(meta.scale))  # updated on exit


def test_gpu_without_fp8_refuses_unless_emulated(gemm_mode):
    if _fp8_gpu():
        pytest.skip("this GPU has FP8 tensor cores")
    with pytest.raises(RuntimeError, match="FASTCAST_GEMM=emulate"):
        with fc.autocast(recipe=fc.Float8CurrentScaling()):
            pass
    gemm_mode("emulate")
    with fc.autocast(recipe=fc.Float8CurrentScaling()):
        pass
