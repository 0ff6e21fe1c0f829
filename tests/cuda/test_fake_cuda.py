"""The CUDA path without a GPU: every recipe's fc.Linear on fake CUDA tensors, with the
compute capability simulated (issue 25, part A; ``fake_cuda.py`` says how).

What runs is what a GPU user's call runs, up to the kernels themselves: the capability
checks, the choice of GEMM path (``torch._scaled_mm`` or the emulation), operand layouts
and alignment padding, the scale shapes and dtypes ``torch._scaled_mm``'s meta checks
accept, and the routing of quantize operators to their compiled (Inductor) forms.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from fake_cuda import fake_parameters, on_fresh_thread, run_backward, simulated_cuda
from gemm_matrix import BLOCK_MM, LAYER, RECIPES, SCALED_MM, SM89, SM90, SM100, linear_paths

import fastcast as fc
from fastcast.runtime import hardware

# Which quantize operators each family launches on CUDA (compiled forms), and the
# dequantize operators an emulated GEMM reads its operands through.
OPERATORS = {
    "delayed": {"quantize_tensorwise", "quantize_recording", "record_amax"},
    "current": {"quantize_tensorwise"},
    "rowwise": {"quantize_rows", "dequantize_blocks"},
    "rowwise_hp_wgrad": {"quantize_rows", "dequantize_blocks"},
    "block": {"quantize_blocks", "dequantize_blocks"},
    "mxfp8": {"quantize_mxfp8", "dequantize_blocks"},
    "nvfp4": {"quantize_nvfp4", "dequantize_nvfp4"},
}


def fresh_thread(test):
    """Run the test on a thread of its own (``on_fresh_thread``): an autocast exit there
    updates only that thread's delayed-scaling state, never real tensors earlier tests
    left in this thread's."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return on_fresh_thread(lambda: test(*args, **kwargs))

    return run


def linear_fwd_bwd(recipe, dtype, tokens=64, k=128, n=256, bias=True):
    layer = fake_parameters(fc.Linear(k, n, bias=bias, dtype=dtype))
    x = torch.empty(tokens, k, device="cuda", dtype=dtype, requires_grad=True)
    with fc.autocast(recipe=recipe):
        y = layer(x)
    run_backward(y, torch.empty_like(y))
    return layer, x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("capability", [SM89, SM90, SM100], ids=["sm89", "sm90", "sm100"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_forward_backward_on_fake_cuda(name, capability, dtype):
    def body():
        with simulated_cuda(capability) as launched:
            linear_fwd_bwd(RECIPES[name], dtype)  # the first step: caches filled
            first_copies = list(launched.host_to_device)
            launched.scaled_mm.clear()
            launched.host_to_device.clear()
            layer, x, y = linear_fwd_bwd(RECIPES[name], dtype)
            assert (y.shape, y.dtype, y.device.type) == ((64, 256), dtype, "cuda")
            assert (x.grad.shape, x.grad.dtype, x.grad.device.type) == ((64, 128), dtype, "cuda")
            assert layer.weight.grad.shape == (256, 128) and layer.weight.grad.dtype == dtype
            assert layer.bias.grad.shape == (256,) and layer.bias.grad.dtype == dtype
        # Only NVFP4's Hadamard matrix is copied to the device, once per process.
        assert len(first_copies) <= (1 if name == "nvfp4" else 0)
        return launched

    launched = on_fresh_thread(body)
    # The GEMM path of each GEMM, as gemm_matrix (docs/cuda.md's table) says, with the
    # scales the kernels take.
    expected = linear_paths(name, capability, dtype, **LAYER)
    ran = {_which_gemm(call, tokens=64, k=128, n=256): _path(call) for call in launched.scaled_mm}
    assert ran == {g: p for g, p in expected.items() if p in (SCALED_MM, BLOCK_MM)}
    for call in launched.scaled_mm:
        _check_kernel_scales(name, call)
    # Quantization ran the compiled CUDA operators, each of this family's, and no step
    # asked the device for a value (a host sync would stall the GPU's queue) or copied
    # from the host.
    assert launched.compiled_ops and set(launched.compiled_ops) <= OPERATORS[name]
    assert launched.host_syncs == [] and launched.host_to_device == []


def _path(call) -> str:
    return BLOCK_MM if "recipes" in call else SCALED_MM


def _logical_k(call) -> tuple[int, int]:
    """``(rows, K)`` of a recorded call's ``a`` (NVFP4 packs two elements a byte)."""
    (m, k), dtype = call["a"]
    return m, k * 2 if dtype == torch.float4_e2m1fn_x2 else k


def _which_gemm(call, tokens: int, k: int, n: int) -> str:
    """Forward ``[tokens, k]``, dgrad ``[tokens, n]`` or wgrad ``[n, tokens]``, by a's shape."""
    return {(tokens, k): "forward", (tokens, n): "dgrad", (n, tokens): "wgrad"}[_logical_k(call)]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _check_kernel_scales(name: str, call) -> None:
    """The scales each kernel reads, from what the kernels take (not fastcast's code)."""
    (m, k), (nn_, b_stride) = _logical_k(call), (call["b"][0][1], call["b"][2])
    assert b_stride[0] == 1  # b is column-major, as cuBLASLt wants b.T row-major
    scaling, swizzle = torch.nn.functional.ScalingType, torch.nn.functional.SwizzleType
    if name.startswith("rowwise"):
        assert call["scale_a"] == ((m, 1), torch.float32)
        assert call["scale_b"] == ((1, nn_), torch.float32)
    elif name == "block":  # 1x128 tiles of a; b's 128x128 tiles, K blocks padded to 4
        assert call["scale_a"] == ((m, k // 128), torch.float32)
        if call["recipes"][1] == [scaling.BlockWise128x128.value]:
            assert call["scale_b"] == ((_round_up(k // 128, 4), nn_ // 128), torch.float32)
    elif name in ("mxfp8", "nvfp4"):
        block, dtype = (32, torch.float8_e8m0fnu) if name == "mxfp8" else (16, torch.float8_e4m3fn)
        levels = (
            [scaling.BlockWise1x32]
            if name == "mxfp8"
            else [
                scaling.BlockWise1x16,
                scaling.TensorWise,
            ]
        )
        swizzles = [swizzle.SWIZZLE_32_4_4] + [swizzle.NO_SWIZZLE] * (len(levels) - 1)
        assert call["recipes"] == [[r.value for r in levels]] * 2
        assert call["swizzles"] == [[s.value for s in swizzles]] * 2
        cols = _round_up(k // block, 4)
        tensor_scale = [((1,), torch.float32)] if name == "nvfp4" else []
        assert call["scales"][0] == [((_round_up(m, 128) * cols,), dtype), *tensor_scale]
        assert call["scales"][1] == [((_round_up(nn_, 128) * cols,), dtype), *tensor_scale]
        assert call["out_dtype"] == torch.bfloat16
    else:
        assert call["scale_a"][0] in ((), (1,)) and call["scale_b"][0] in ((), (1,))
        assert call["scale_a"][1] == call["scale_b"][1] == torch.float32


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "current"])
def test_token_counts_off_the_block_are_padded_on_cuda(name):
    """33 tokens: the weight gradient's blocks run along the tokens, so MXFP8 (32) and
    NVFP4 (16) pad them; the output and gradients keep the user's 33 rows."""

    def body():
        with simulated_cuda(SM100):
            layer, x, y = linear_fwd_bwd(RECIPES[name], torch.bfloat16, tokens=33)
            assert y.shape == (33, 256) and x.grad.shape == (33, 128)
            assert layer.weight.grad.shape == (256, 128)

    on_fresh_thread(body)


@pytest.mark.parametrize("name", list(RECIPES))
def test_no_grad_forward_on_fake_cuda(name):
    """Inference (no autograd): forward only, and no column-wise layouts made."""

    def body():
        with simulated_cuda(SM90) as launched:
            layer = fake_parameters(fc.Linear(128, 256, dtype=torch.bfloat16))
            x = torch.empty(2, 16, 128, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad(), fc.autocast(recipe=RECIPES[name]):
                y = layer(x)
            assert (y.shape, y.dtype) == ((2, 16, 256), torch.bfloat16)
        return launched

    launched = on_fresh_thread(body)
    assert len(launched.scaled_mm) <= 1 and launched.host_syncs == []


@pytest.mark.parametrize("capability", [SM89, SM90, SM100], ids=["sm89", "sm90", "sm100"])
def test_block_scaling_runs_the_tile_kernel_on_sm90(capability):
    """A bias-free bf16 layer with whole 128-tiles (256 tokens): on sm90 all three GEMMs
    run cuBLASLt's 1x128/128x128 kernel (forward and dgrad 1x128 x 128x128, wgrad 1x128
    x 1x128), with scales torch's meta checks accept; elsewhere, or with torch's older
    CUDA, none does (emulated)."""

    def body(cuda_version):
        with simulated_cuda(capability, cuda_version=cuda_version) as launched:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the emulation's warning off sm90
                linear_fwd_bwd(fc.Float8BlockScaling(), torch.bfloat16, tokens=256, bias=False)
        return launched

    launched = on_fresh_thread(body, "12.9")
    if capability != SM90:
        assert launched.scaled_mm == []
        return
    recipes = [call["recipes"] for call in launched.scaled_mm]
    scaling = torch.nn.functional.ScalingType
    tile, square = scaling.BlockWise1x128.value, scaling.BlockWise128x128.value
    assert sorted(recipes) == sorted([[[tile], [square]], [[tile], [square]], [[tile], [tile]]])
    assert all(call["out_dtype"] == torch.bfloat16 for call in launched.scaled_mm)
    assert on_fresh_thread(body, "12.8").scaled_mm == []  # cuBLASLt before 12.9


def test_unaligned_features_fall_back_to_the_emulation():
    """The FP8 kernels need K and N multiples of 16: other shapes run emulated, same
    outputs' shapes and dtypes."""

    def body():
        with simulated_cuda(SM90) as launched:
            layer, x, y = linear_fwd_bwd(fc.Float8CurrentScaling(), torch.bfloat16, k=120, n=200)
            assert y.shape == (64, 200) and layer.weight.grad.shape == (200, 120)
        return launched

    assert on_fresh_thread(body).scaled_mm == []


@fresh_thread
def test_torch_autocast_bf16_output_on_fake_cuda():
    """Under torch.autocast the layer's output takes autocast's dtype, as nn.Linear's;
    without a bias (an FP32 bias is added to the FP32 product first) the kernel writes it."""
    with simulated_cuda(SM90) as launched:
        layer = fake_parameters(fc.Linear(128, 256, bias=False))
        x = torch.empty(64, 128, device="cuda", requires_grad=True)
        with (
            torch.autocast("cuda", dtype=torch.bfloat16),
            fc.autocast(recipe=fc.Float8CurrentScaling()),
        ):
            y = layer(x)
        assert y.dtype == torch.bfloat16
    assert launched.scaled_mm[0]["out_dtype"] == torch.bfloat16


@fresh_thread
def test_gpus_without_fp8_refuse_clearly_unless_emulated(monkeypatch):
    with simulated_cuda((8, 0)):
        ok, reason = fc.fp8_available()
        assert not ok and "8.9" in reason and "8.0" in reason
        with pytest.raises(RuntimeError, match="compute capability 8.9"):
            with fc.autocast(recipe=fc.Float8CurrentScaling()):
                pass
        monkeypatch.setenv("FASTCAST_GEMM", "emulate")
        hardware.refresh()
        layer, x, y = linear_fwd_bwd(fc.Float8CurrentScaling(), torch.bfloat16)
        assert y.shape == (64, 256)


@fresh_thread
def test_compiled_operators_are_chosen_for_cuda_without_running_the_device():
    from fastcast.kernels import choice

    with simulated_cuda(SM90) as launched:
        x = torch.empty(64, 128, device="cuda")
        op = choice.fused_op("quantize_tensorwise", x)
        assert op is not None and op.__name__ == "quantize_tensorwise"
        assert launched.compiled_ops == []  # chosen, not yet called


@fresh_thread
def test_missing_triton_runs_the_reference_after_one_warning(monkeypatch):
    from fastcast.kernels import choice

    with simulated_cuda(SM90, triton=False) as launched:
        x = torch.empty(64, 128, device="cuda")
        with pytest.warns(RuntimeWarning, match="triton"):
            assert choice.fused_op("quantize_tensorwise", x) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert choice.fused_op("quantize_rows", x) is None  # warned once only
        layer, x, y = linear_fwd_bwd(fc.Float8CurrentScaling(), torch.bfloat16)
        assert y.shape == (64, 256)
        assert launched.compiled_ops == []
        monkeypatch.setenv("FASTCAST_KERNELS", "fused")
        choice.refresh()
        with pytest.raises(RuntimeError, match="FASTCAST_KERNELS=fused"):
            choice.fused_op("quantize_tensorwise", x)
