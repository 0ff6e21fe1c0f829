"""The GEMM paths of docs/cuda.md's table on fake CUDA tensors, beyond test_fake_cuda's
layer: bias-free layers of whole tiles (every block-scaled kernel), a torch without
``F.scaled_mm``, ``fc.GroupedLinear`` and converted transformers experts.

Each case asserts, GEMM by GEMM, the path ``gemm_matrix`` gives (written from what
torch's kernels accept); torch's meta checks of ``F.scaled_mm`` and
``torch._scaled_grouped_mm`` run on every kernel call.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from fake_cuda import fake_parameters, on_fresh_thread, run_backward, simulated_cuda
from gemm_matrix import (
    BLOCK_MM,
    CAPABILITIES,
    DTYPES,
    EMULATED,
    GROUPED_MM,
    HIGH,
    RECIPES,
    SCALED_MM,
    SM100,
    WHOLE_TILES,
    grouped_paths,
    linear_paths,
    with_table,
)

import fastcast as fc

KERNELS = (SCALED_MM, BLOCK_MM)


def _quiet():
    """Warnings off: the emulation's one warning per family is tested elsewhere."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")
    return ctx


def _second_step(launched, step) -> None:
    """Run ``step`` twice and keep what the second one launched: the first fills the
    process-wide caches (NVFP4's Hadamard matrix is copied to the device once)."""
    step()
    for record in (launched.scaled_mm, launched.scaled_grouped_mm, launched.grouped_mm):
        record.clear()
    launched.host_to_device.clear()
    step()


def _dense_path(call) -> tuple[tuple[int, int], str]:
    (m, k), dtype = call["a"]
    k = k * 2 if dtype == torch.float4_e2m1fn_x2 else k
    return (m, k), BLOCK_MM if "recipes" in call else SCALED_MM


@pytest.mark.parametrize("capability", list(CAPABILITIES.values()), ids=list(CAPABILITIES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_bias_free_whole_tile_layer_paths(name, capability):
    """256 tokens, 128 -> 384, no bias, bf16: the block-scaled kernels run every GEMM
    they have."""
    tokens, k, n = WHOLE_TILES["tokens"], WHOLE_TILES["k"], WHOLE_TILES["n"]

    def body():
        with simulated_cuda(capability) as launched:
            ctx = _quiet()
            layer = fake_parameters(fc.Linear(k, n, bias=False, dtype=torch.bfloat16))
            x = torch.empty(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with fc.autocast(recipe=RECIPES[name]):
                y = layer(x)
            run_backward(y, torch.empty_like(y))
            ctx.__exit__(None, None, None)
            assert x.grad.shape == (tokens, k) and layer.weight.grad.shape == (n, k)
        return launched

    launched = on_fresh_thread(body)
    which = {(tokens, k): "forward", (tokens, n): "dgrad", (n, tokens): "wgrad"}
    ran = dict((which[shape], path) for shape, path in (_dense_path(c) for c in launched.scaled_mm))
    assert len(ran) == len(launched.scaled_mm)
    expected = linear_paths(name, capability, torch.bfloat16, **WHOLE_TILES)
    assert ran == {g: p for g, p in expected.items() if p in KERNELS}
    assert launched.host_syncs == []


def test_docs_table_is_the_one_these_tests_assert():
    """docs/cuda.md's GEMM-path table is ``gemm_matrix``'s rendering (regenerate it with
    ``python tests/cuda/gemm_matrix.py --write``)."""
    text = (Path(__file__).parents[2] / "docs" / "cuda.md").read_text()
    assert with_table(text) == text


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_older_cuda_runtime_emulates_the_microscaled_products(name):
    """cuBLASLt's MXFP8/NVFP4 kernels came with CUDA 12.8: torch built for 12.6 has none."""

    def body():
        with simulated_cuda(SM100, cuda_version="12.6") as launched:
            ctx = _quiet()
            layer = fake_parameters(fc.Linear(128, 256, bias=False, dtype=torch.bfloat16))
            x = torch.empty(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with fc.autocast(recipe=RECIPES[name]):
                run_backward(layer(x), torch.empty(256, 256, device="cuda", dtype=torch.bfloat16))
            ctx.__exit__(None, None, None)
        return launched

    assert on_fresh_thread(body).scaled_mm == []


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "block"])
def test_torch_without_scaled_mm_warns_once_naming_its_version(name, monkeypatch):
    """torch before 2.10 has no ``F.scaled_mm``: the block-scaled recipes run emulated,
    after one warning that names the installed version."""
    monkeypatch.delattr(torch.nn.functional, "scaled_mm")
    capability = SM100 if name != "block" else (9, 0)

    def body():
        with simulated_cuda(capability) as launched:
            layer = fake_parameters(fc.Linear(128, 256, bias=False, dtype=torch.bfloat16))
            x = torch.empty(256, 128, device="cuda", dtype=torch.bfloat16)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(3):
                    with torch.no_grad(), fc.autocast(recipe=RECIPES[name]):
                        layer(x)
        return launched, [str(w.message) for w in caught if w.category is RuntimeWarning]

    launched, messages = on_fresh_thread(body)
    assert launched.scaled_mm == []
    assert len(messages) == 1 and torch.__version__ in messages[0]
    assert "scaled_mm" in messages[0]


def test_scaled_mm_without_swizzles_keeps_the_tile_kernel_only(monkeypatch):
    """An ``F.scaled_mm`` that takes no swizzled scales: MXFP8 on sm100 is emulated
    (with a warning saying so), 1x128 tiles on sm90 still run on the kernel."""
    monkeypatch.delattr(torch.nn.functional, "SwizzleType")

    def body(name, capability):
        with simulated_cuda(capability) as launched:
            layer = fake_parameters(fc.Linear(128, 256, bias=False, dtype=torch.bfloat16))
            x = torch.empty(256, 128, device="cuda", dtype=torch.bfloat16)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.no_grad(), fc.autocast(recipe=RECIPES[name]):
                    layer(x)
        return launched, [str(w.message) for w in caught if w.category is RuntimeWarning]

    launched, messages = on_fresh_thread(body, "mxfp8", SM100)
    assert launched.scaled_mm == [] and len(messages) == 1 and "swizzled" in messages[0]
    launched, messages = on_fresh_thread(body, "block", (9, 0))
    assert len(launched.scaled_mm) == 1 and messages == []


# -- grouped experts --------------------------------------------------------------------------
def _grouped_calls(launched, tokens: int, k: int, n: int) -> dict[str, str]:
    """Which grouped GEMM each ``torch._scaled_grouped_mm`` call was, by its a's shape:
    forward ``[T, K]``, dgrad ``[T, N]``, wgrad ``[N, padded T]``."""
    ran = {}
    for call in launched.scaled_grouped_mm:
        rows, cols = call["a"][0]
        gemm = "wgrad" if rows == n else {k: "forward", n: "dgrad"}[cols]
        assert call["a"][1] == call["b"][1] == torch.float8_e4m3fn
        assert call["scale_a"][1] == call["scale_b"][1] == torch.float32
        ran[gemm] = GROUPED_MM
    return ran


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("capability", list(CAPABILITIES.values()), ids=list(CAPABILITIES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_linear_paths(name, capability, dtype):
    """fc.GroupedLinear (4 groups, 64 tokens, 128 -> 256): each grouped GEMM on
    ``torch._scaled_grouped_mm`` where the table says, else the FP32 emulation."""

    def body():
        with simulated_cuda(capability) as launched:
            ctx = _quiet()
            layer = fake_parameters(fc.GroupedLinear(4, 128, 256, dtype=dtype))

            def step():
                x = torch.empty(64, 128, device="cuda", dtype=dtype, requires_grad=True)
                offs = torch.empty(4, device="cuda", dtype=torch.int32)
                with fc.autocast(recipe=RECIPES[name]):
                    y = layer(x, offs)
                run_backward(y, torch.empty_like(y))
                assert (y.shape, y.dtype) == ((64, 256), dtype)
                assert x.grad.shape == (64, 128) and layer.weight.grad.shape == (4, 256, 128)

            _second_step(launched, step)
            ctx.__exit__(None, None, None)
        return launched

    launched = on_fresh_thread(body)
    expected = grouped_paths(name, capability)
    assert _grouped_calls(launched, 64, 128, 256) == {
        g: p for g, p in expected.items() if p == GROUPED_MM
    }
    # Every other grouped GEMM is an FP32 torch._grouped_mm: on CUDA, torch's fallback,
    # which reads the group ends back to the host (a sync per call; docs/cuda.md).
    fp32 = [d for d in launched.grouped_mm if d == torch.float32]
    assert len(fp32) == sum(p in (EMULATED, HIGH) for p in expected.values())
    assert launched.host_syncs == [] and launched.host_to_device == []


transformers = pytest.importorskip("transformers")


def _qwen3_experts():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.Qwen3MoeForCausalLM(cfg).model.layers[0].mlp.experts


# FP32 experts behind `slow` (make test-slow): the FP32 grouped paths are the same
# GEMMs fc.GroupedLinear's FP32 cases above assert, and these cost ~25 s of make test.
_EXPERT_DTYPES = [
    pytest.param(dtype, id=name, marks=[pytest.mark.slow] if name == "fp32" else [])
    for name, dtype in DTYPES.items()
]


@pytest.mark.parametrize("dtype", _EXPERT_DTYPES)
@pytest.mark.parametrize("capability", list(CAPABILITIES.values()), ids=list(CAPABILITIES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_converted_experts_paths(name, capability, dtype):
    """A converted Qwen3-MoE experts module (gate_up and down projections): six grouped
    GEMMs a step, each on the path the table gives."""
    experts = _qwen3_experts().to(dtype)
    fc.convert(experts, recipe=RECIPES[name])

    def body():
        with simulated_cuda(capability) as launched:
            ctx = _quiet()
            fake_parameters(experts)

            def step():
                h = torch.empty(32, 128, device="cuda", dtype=dtype, requires_grad=True)
                index = torch.empty(32, 2, device="cuda", dtype=torch.int64)
                weights = torch.empty(32, 2, device="cuda", dtype=dtype)
                with fc.autocast(recipe=RECIPES[name]):
                    out = experts(h, index, weights)
                run_backward(out, torch.empty_like(out))
                assert (out.shape, out.dtype) == ((32, 128), dtype)
                assert h.grad.shape == (32, 128)

            _second_step(launched, step)
            ctx.__exit__(None, None, None)
        return launched

    launched = on_fresh_thread(body)
    expected = grouped_paths(name, capability)
    kernels = sum(p == GROUPED_MM for p in expected.values())
    assert len(launched.scaled_grouped_mm) == 2 * kernels  # two projections
    fp32 = [d for d in launched.grouped_mm if d == torch.float32]
    assert len(fp32) == 2 * sum(p in (EMULATED, HIGH) for p in expected.values())
    assert launched.host_syncs == [] and launched.host_to_device == []
