"""Float8RowwiseScaling: row-wise FP8 against a float64 reference written from the definition.

The reference never calls fastcast. A layout of the matrix ``m`` ``[R, K]`` has one scale
per row: ``fmt_max / max_k |m[r, k]|`` evaluated in float64 and rounded once to FP32
(double rounding from 53 to 24 bits is innocuous for one division, so that is the
correctly rounded FP32 quotient), the FP32 max where the quotient is beyond it, 1.0 for a
row whose amax is 0, NaN or infinite; with power-of-2 scales the largest power of two not
above it. The codes are ``round_to_fp8(fp32(m[r, k] * scale_r))`` (``fp8_reference``:
nearest, ties to even, finite values saturating, infinities non-finite). The column-wise
layout is the same definition applied to ``m.T``: each GEMM operand is scaled per row of
the matrix whose last dim the GEMM contracts.
"""

from __future__ import annotations

import math

import pytest
import torch
from fp8_reference import (
    FP32_MAX,
    assert_codes_equal,
    decode_fp8,
    encode_fp8,
    reference_scale,
    to_f32,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_linear import _saved_tensors, assert_checkpointing_changes_nothing
from torch import nn

import fastcast as fc
from fastcast.kernels import choice
from fastcast.quantizers import RowwiseQuantizer
from fastcast.tensor import ROWWISE, Float8Tensor

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(params=["fused", "reference"])
def kernels(request, monkeypatch):
    """Each quantization test runs the fused C++ operator and the PyTorch reference
    (``FASTCAST_KERNELS``); both must meet the definition."""
    if request.param == "fused" and choice.fused_op("quantize_rows", torch.empty(1)) is None:
        pytest.skip("the fused kernels are not available here")
    monkeypatch.setenv("FASTCAST_KERNELS", "auto" if request.param == "fused" else "reference")
    choice.refresh()
    yield request.param
    monkeypatch.undo()
    choice.refresh()


FMTS = ["e4m3", "e5m2"]
HYBRID = fc.Format.HYBRID
PLAIN = fc.Float8RowwiseScaling()
HP = fc.Float8RowwiseScaling(wgrad_high_precision=True)


# -- reference -----------------------------------------------------------------------------
ref_scale = reference_scale  # one row's scale (fp8_reference.py: the definition)


def ref_amax(row: torch.Tensor) -> float:
    v = row.double()
    if v.numel() == 0:
        return 0.0
    return math.nan if bool(v.isnan().any()) else v.abs().max().item()


def ref_row_scales(m: torch.Tensor, fmt: str, power_2: bool) -> torch.Tensor:
    """float64 ``[R, 1]`` of the FP32 scales of ``m``'s rows."""
    return torch.tensor(
        [[ref_scale(ref_amax(row), fmt, power_2)] for row in m], dtype=torch.float64
    )


def ref_codes(m: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 codes of ``fp32(m * scale)``, row by row (the float64 product of two FP32
    values is exact; ``.float()`` rounds it once)."""
    product = (m.double() * scales).float().double()
    # A finite value whose FP32 product overflows is still finite: it saturates.
    product = torch.where(m.isinf(), product, product.clamp(-FP32_MAX, FP32_MAX))
    return encode_fp8(product, fmt)


def ref_dequantized(m: torch.Tensor, fmt: str, power_2: bool, per_tensor: bool = False):
    """float64 value of ``m`` quantized row by row (or with one scale, ``per_tensor``)."""
    if per_tensor:
        scale = ref_scale(ref_amax(m.reshape(-1)), fmt, power_2)
        scales = torch.full((m.shape[0], 1), scale, dtype=torch.float64)
    else:
        scales = ref_row_scales(m, fmt, power_2)
    return decode_fp8(ref_codes(m, scales, fmt), fmt) / scales


def check_layout(data, scale_inv, m, fmt, power_2, per_tensor=False):
    """Bit-exact codes and FP32 ``scale_inv`` ``[R, 1]`` of one layout of the matrix ``m``."""
    if per_tensor:
        s = ref_scale(ref_amax(m.reshape(-1)), fmt, power_2)
        scales = torch.full((m.shape[0], 1), s, dtype=torch.float64)
    else:
        scales = ref_row_scales(m, fmt, power_2)
    assert scale_inv.dtype == torch.float32 and tuple(scale_inv.shape) == (m.shape[0], 1)
    expected_inv = torch.tensor([[to_f32(1.0 / s)] for s in scales.flatten().tolist()])
    assert torch.equal(scale_inv, expected_inv.reshape(scale_inv.shape))
    assert tuple(data.shape) == tuple(m.shape)
    assert_codes_equal(data.contiguous(), ref_codes(m, scales, fmt), fmt)


def sample(shape, dtype=torch.float32, seed=0, spread=6):
    """randn with a per-row magnitude 2**k, k in [-spread, spread], and different column
    magnitudes too (so that row and column scales both vary)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    k = torch.randint(-spread, spread + 1, tuple(shape[:-1]) + (1,), generator=g)
    c = torch.randint(-2, 3, (shape[-1],), generator=g)
    return (x * torch.pow(2.0, k.double()) * torch.pow(2.0, c.double())).to(dtype)


def matrix(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


CASES = {
    "2d-f32": lambda: sample((33, 70), seed=1),
    "2d-bf16": lambda: sample((16, 40), torch.bfloat16, seed=2),
    "2d-f16": lambda: sample((9, 31), torch.float16, seed=3),
    "1d-f32": lambda: sample((257,), seed=4),
    "3d-bf16": lambda: sample((3, 5, 24), torch.bfloat16, seed=5),
    "transposed-f32": lambda: sample((40, 24), seed=6).t(),
    "sliced-f16": lambda: sample((20, 64), torch.float16, seed=7)[3:17, ::3],
    "permuted-3d-f32": lambda: sample((4, 6, 10), seed=8).permute(1, 0, 2),
}


def test_reference_scale_definition():
    assert ref_scale(1.0, "e4m3", False) == 448.0
    assert ref_scale(3.0, "e4m3", False) == to_f32(448.0 / 3.0)
    assert ref_scale(3.0, "e4m3", True) == 128.0
    assert ref_scale(7.0, "e4m3", True) == 64.0  # 448 / 7 = 64 exactly
    assert ref_scale(0.0, "e5m2", False) == ref_scale(math.nan, "e5m2", True) == 1.0
    assert ref_scale(math.inf, "e4m3", False) == 1.0
    assert ref_scale(1e-40, "e4m3", False) == FP32_MAX
    assert ref_scale(1e-40, "e4m3", True) == 2.0**127


# -- quantization: bit-exact against the reference --------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("power_2", [True, False], ids=["pow2", "f32-scales"])
@pytest.mark.parametrize("fmt", FMTS)
def test_both_layouts_match_the_reference(case, power_2, fmt, kernels):
    x = CASES[case]()
    q = RowwiseQuantizer(fmt=fmt, power_2_scales=power_2).quantize(x, rowwise=True, columnwise=True)
    assert isinstance(q, Float8Tensor) and q.family == ROWWISE
    assert q.fmt == fmt and q.shape == x.shape and q.dtype == x.dtype
    assert q.block == q.block_t == (1, 0)
    m = x.reshape(1, -1) if x.dim() == 1 else matrix(x)
    assert q.data.shape == x.shape
    check_layout(
        matrix(q.data) if x.dim() != 1 else q.data.reshape(1, -1), q.scale_inv, m, fmt, power_2
    )
    # The column-wise layout: x.T quantized on its own rows (x's columns).
    check_layout(q.data_t, q.scale_inv_t, m.t(), fmt, power_2)
    if power_2:
        for s in (q.scale_inv, q.scale_inv_t):
            mantissa, _ = torch.frexp(s)
            assert bool((mantissa == 0.5).all())  # powers of two
    # Each layout alone is the same as in the pair.
    alone = RowwiseQuantizer(fmt=fmt, power_2_scales=power_2).quantize(
        x, columnwise=True, rowwise=False
    )
    assert alone.data is None and torch.equal(
        alone.data_t.view(torch.uint8), q.data_t.view(torch.uint8)
    )
    assert q.dequantize().shape == x.shape and q.dequantize().dtype == x.dtype


def test_scales_really_are_per_row_along_the_contracted_dim():
    """Rows of very different magnitudes keep their precision: each row's largest value
    lands on the format's max, which one shared scale could not do."""
    x = sample((16, 64), seed=9, spread=8)
    q = RowwiseQuantizer(power_2_scales=False).quantize(x, columnwise=True)
    assert len(set(q.scale_inv.flatten().tolist())) > 4
    assert len(set(q.scale_inv_t.flatten().tolist())) > 2
    assert torch.equal(q.data.float().abs().amax(dim=1), torch.full((16,), 448.0))
    assert torch.equal(q.data_t.float().abs().amax(dim=1), torch.full((64,), 448.0))


@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("fmt", FMTS)
def test_columnwise_per_tensor_has_one_scale_stored_per_row(fmt, rowwise, kernels):
    """rowwise_with_gw_hp's weight for dgrad: one scale for the whole tensor."""
    x = sample((24, 48), seed=10)
    q = RowwiseQuantizer(fmt=fmt, columnwise_per_tensor=True).quantize(
        x, rowwise=rowwise, columnwise=True
    )
    check_layout(q.data_t, q.scale_inv_t, x.t(), fmt, True, per_tensor=True)
    assert len(set(q.scale_inv_t.flatten().tolist())) == 1
    if rowwise:  # the row-wise layout stays per row
        check_layout(q.data, q.scale_inv, x, fmt, True)
    x[3, 7] = math.nan  # a NaN anywhere: the whole-tensor scale falls back to 1
    q = RowwiseQuantizer(fmt=fmt, columnwise_per_tensor=True).quantize(
        x, rowwise=rowwise, columnwise=True
    )
    assert torch.equal(q.scale_inv_t, torch.ones(48, 1))
    check_layout(q.data_t, q.scale_inv_t, x.t(), fmt, True, per_tensor=True)


@pytest.mark.parametrize("power_2", [True, False])
@pytest.mark.parametrize("fmt", FMTS)
def test_non_finite_zero_and_tiny_rows(fmt, power_2, kernels):
    """A row holding NaN or +-inf, or only zeros, gets scale 1 (finite); its non-finite
    values stay non-finite; a row of FP32 subnormals gets the FP32 max (or 2**127); every
    other row is quantized as without those rows."""
    x = sample((8, 32), seed=11)
    x[0] = 0.0
    x[1, 5] = math.nan
    x[2, 6] = math.inf
    x[3, 7] = -math.inf
    x[4] = 1e-40 * torch.linspace(-1, 1, 32)
    x[5, :3] = torch.tensor([0.0, -0.0, 0.0])
    q = RowwiseQuantizer(fmt=fmt, power_2_scales=power_2).quantize(x, columnwise=True)
    check_layout(q.data, q.scale_inv, x, fmt, power_2)
    check_layout(q.data_t, q.scale_inv_t, x.t(), fmt, power_2)
    assert q.scale_inv[:4].flatten().tolist() == [1.0] * 4
    assert bool(q.scale_inv.isfinite().all()) and bool(q.scale_inv_t.isfinite().all())
    deq = q.dequantize()
    assert torch.equal(deq[0], torch.zeros(32))
    assert math.isnan(deq[1, 5].item())
    if fmt == "e5m2":
        assert deq[2, 6].item() == math.inf and deq[3, 7].item() == -math.inf
    else:  # E4M3 has no infinity
        assert math.isnan(deq[2, 6].item()) and math.isnan(deq[3, 7].item())
    assert torch.equal(deq[4:].isfinite(), torch.ones(4, 32, dtype=torch.bool))
    # The clean rows, quantized alone, give the same codes and scales.
    clean = RowwiseQuantizer(fmt=fmt, power_2_scales=power_2).quantize(x[4:])
    assert torch.equal(q.data[4:].view(torch.uint8), clean.data.view(torch.uint8))
    assert torch.equal(q.scale_inv[4:], clean.scale_inv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("power_2", [True, False])
@pytest.mark.parametrize("fmt", FMTS)
def test_values_near_the_fp32_max_stay_finite(fmt, power_2, dtype, kernels):
    """Rows and columns whose amax lies in the dtype's top binade (its max included):
    codes and scales as the reference defines them (a power-of-two scale no smaller than
    fmt_max / FP32_MAX allows), and every value dequantizes to a finite one."""
    top = float(torch.finfo(dtype).max)
    x = sample((24, 40), torch.float64, seed=12)
    x[0] = top * torch.linspace(-1, 1, 40, dtype=torch.float64)
    x[1] = -top * 0.999
    x[:, 3] = top * torch.linspace(0.5, 1, 24, dtype=torch.float64)
    x = x.to(dtype)
    assert bool(x.isfinite().all())
    for quantizer in (
        RowwiseQuantizer(fmt=fmt, power_2_scales=power_2),
        RowwiseQuantizer(fmt=fmt, power_2_scales=power_2, columnwise_per_tensor=True),
    ):
        q = quantizer.quantize(x, columnwise=True)
        check_layout(q.data, q.scale_inv, x, fmt, power_2)
        per_tensor = quantizer.columnwise_per_tensor
        check_layout(q.data_t, q.scale_inv_t, x.t(), fmt, power_2, per_tensor=per_tensor)
        for deq in (q.dequantize(torch.float32), q.t().dequantize(torch.float32), q.dequantize()):
            assert bool(deq.isfinite().all())


@pytest.mark.parametrize("shape", [(0, 16), (16, 0), (0, 0), (2, 0, 8)])
def test_empty_tensors(shape, kernels):
    x = torch.randn(shape)
    q = RowwiseQuantizer().quantize(x, rowwise=True, columnwise=True)
    rows = math.prod(shape[:-1])
    assert q.data.shape == x.shape and q.scale_inv.shape == (rows, 1)
    assert q.data_t.shape == (shape[-1], rows) and q.scale_inv_t.shape == (shape[-1], 1)
    assert q.dequantize().shape == x.shape


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 20),
    cols=st.integers(1, 40),
    fmt=st.sampled_from(FMTS),
    power_2=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    exponent=st.integers(-20, 20),
    seed=st.integers(0, 2**16),
)
def test_property_matches_the_reference(rows, cols, fmt, power_2, dtype, exponent, seed):
    x = (sample((rows, cols), seed=seed) * 2.0**exponent).to(dtype)
    q = RowwiseQuantizer(fmt=fmt, power_2_scales=power_2).quantize(x, columnwise=True)
    check_layout(q.data, q.scale_inv, x, fmt, power_2)
    check_layout(q.data_t, q.scale_inv_t, x.t(), fmt, power_2)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="RowwiseQuantizer: fmt must be e4m3 or e5m2"):
        RowwiseQuantizer(fmt="e2m1")
    with pytest.raises(ValueError, match="power_2_scales must be a bool"):
        RowwiseQuantizer(power_2_scales=1)
    with pytest.raises(ValueError, match="columnwise_per_tensor must be a bool"):
        RowwiseQuantizer(columnwise_per_tensor=None)
    with pytest.raises(TypeError, match="int64"):
        RowwiseQuantizer().quantize(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="rowwise and/or columnwise"):
        RowwiseQuantizer().quantize(torch.ones(4, 4), rowwise=False)
    # A value object (what torch.compile and the plans' caches rely on).
    assert RowwiseQuantizer("e5m2") == RowwiseQuantizer("e5m2") != RowwiseQuantizer()
    assert hash(RowwiseQuantizer()) == hash(RowwiseQuantizer())


# -- the recipe: roles, formats, the torchao recipes it mirrors --------------------------------
def test_recipe_defaults_are_torchaos_rowwise_and_roles_pick_formats():
    assert PLAIN.fp8_format is fc.Format.E4M3 and PLAIN.use_power_2_scales
    assert not PLAIN.wgrad_high_precision and HP.wgrad_high_precision
    x = sample((16, 32), seed=12)
    for role in ("input", "weight", "grad_output"):
        q = fc.quantize(x, PLAIN, role, columnwise=True)
        assert q.fmt == "e4m3"
        check_layout(q.data, q.scale_inv, x, "e4m3", True)
        check_layout(q.data_t, q.scale_inv_t, x.t(), "e4m3", True)
    hybrid = fc.Float8RowwiseScaling(fp8_format=HYBRID, use_power_2_scales=False)
    q = fc.quantize(x, hybrid, "grad_output", columnwise=True)
    check_layout(q.data, q.scale_inv, x, "e5m2", False)
    check_layout(q.data_t, q.scale_inv_t, x.t(), "e5m2", False)
    assert fc.quantize(x, hybrid, "input").fmt == "e4m3"
    # With a high-precision wgrad only the weight's dgrad layout changes: one scale.
    w = fc.quantize(x, HP, "weight", columnwise=True)
    check_layout(w.data, w.scale_inv, x, "e4m3", True)
    check_layout(w.data_t, w.scale_inv_t, x.t(), "e4m3", True, per_tensor=True)
    ok, reason = fc.fp8_rowwise_available()
    assert ok and fc.schemes.recipe_support(PLAIN) == (ok, reason)


def test_cpu_emulates_per_row_gemms_unless_told_otherwise(gemm_mode):
    """torch._scaled_mm's CPU kernel takes per-row scales but is slower than the
    emulation: ``auto`` emulates them, ``FASTCAST_GEMM=hardware`` runs the kernel."""
    from fastcast.runtime.hardware import gemm_backend

    gemm_mode("auto")
    assert gemm_backend("cpu", ROWWISE)[0] == "emulate"
    assert gemm_backend("cpu", "tensorwise")[0] == "hardware"
    gemm_mode("hardware")
    assert gemm_backend("cpu", ROWWISE)[0] == "hardware"


def test_same_codes_and_scales_as_torchao():
    """torchao's ``rowwise`` casts (axis-wise, power-of-2 scales, E4M3), where both
    define the same thing (finite rows, no zero row: torchao floors the amax at 1e-12)."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    x = sample((48, 80), seed=13)
    q = fc.quantize(x, PLAIN, "input", columnwise=True)
    for axiswise_dim, data, scale_inv in (
        (-1, q.data, q.scale_inv),
        (0, q.data_t.t(), q.scale_inv_t.t()),
    ):
        ao = hp_tensor_to_float8_dynamic(
            x,
            torch.float8_e4m3fn,
            LinearMMConfig(),
            scaling_granularity=ScalingGranularity.AXISWISE,
            axiswise_dim=axiswise_dim,
            round_scales_to_power_of_2=True,
        )
        assert torch.equal(ao._data.view(torch.uint8), data.contiguous().view(torch.uint8))
        assert torch.equal(ao._scale.reciprocal(), scale_inv)


# -- GEMM: torch._scaled_mm's CPU kernel and the emulation ------------------------------------
@pytest.mark.parametrize("backend", ["hardware", "emulate"])
def test_scaled_mm_of_per_row_operands(backend):
    x, w = sample((2, 20, 64), seed=14), sample((24, 64), seed=15)
    a = fc.quantize(x, PLAIN, "input")
    b = fc.quantize(w, HP, "weight", columnwise=True)
    ref = ref_dequantized(matrix(x), "e4m3", True) @ ref_dequantized(w, "e4m3", True).T
    out = fc.scaled_mm(a, b, backend=backend)
    assert out.shape == (2, 20, 24)
    assert_close_to(out.reshape(40, 24), ref)
    # dgrad's operand with the per-tensor scale stored per row: still a row-wise GEMM.
    g = fc.quantize(sample((40, 24), seed=16), PLAIN, "grad_output")
    ref = (
        ref_dequantized(sample((40, 24), seed=16), "e4m3", True)
        @ ref_dequantized(w.t(), "e4m3", True, per_tensor=True).T
    )
    assert_close_to(fc.scaled_mm(g, b.t(), backend=backend), ref)


def assert_close_to(actual, expected, rel=1e-5):
    """Within ``rel`` of ``expected``'s largest magnitude: FP32 accumulation of the same
    quantized operands."""
    expected, actual = expected.double(), actual.double()
    assert actual.shape == expected.shape
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= rel * scale


# -- fc.Linear: forward and both gradients ----------------------------------------------------
def linear_reference(x, weight, bias, g, recipe):
    """float64 output, input gradient and weight gradient from the reference's quantized
    operands: forward x per token @ W per output feature; dgrad g per token @ W per input
    feature (per tensor with a high-precision wgrad); wgrad g.T per output feature @ x.T
    per input feature, or the unquantized g.T @ x."""
    fmt_x, fmt_g = recipe.fp8_format.fwd, recipe.fp8_format.bwd
    p2, hp = recipe.use_power_2_scales, recipe.wgrad_high_precision
    x2, g2, w = matrix(x.detach()), matrix(g), weight.detach()
    out = ref_dequantized(x2, fmt_x, p2) @ ref_dequantized(w, fmt_x, p2).T
    if bias is not None:
        out = out + bias.detach().double()
    w_t = ref_dequantized(w.t(), fmt_x, p2, per_tensor=hp)  # [K, N]
    dx = ref_dequantized(g2, fmt_g, p2) @ w_t.T
    if hp:
        dw = g2.double().T @ x2.double()
    else:
        dw = ref_dequantized(g2.t(), fmt_g, p2) @ ref_dequantized(x2.t(), fmt_x, p2).T
    return out.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw


RECIPES = {
    "rowwise": PLAIN,
    "rowwise-gw-hp": HP,
    "hybrid-f32-scales": fc.Float8RowwiseScaling(fp8_format=HYBRID, use_power_2_scales=False),
    "hybrid-gw-hp": fc.Float8RowwiseScaling(fp8_format=HYBRID, wgrad_high_precision=True),
}


@pytest.mark.parametrize("gemm_mode", ["hardware", "emulate"], indirect=True)
@pytest.mark.parametrize("x_shape", [(48, 64), (3, 17, 64)], ids=["2d", "3d-odd-tokens"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_matches_the_reference(name, x_shape, gemm_mode):
    recipe = RECIPES[name]
    torch.manual_seed(17)
    lin = fc.Linear(64, 96)
    x = sample(x_shape, seed=18).requires_grad_()
    g = sample((*x_shape[:-1], 96), seed=19, spread=3)
    with fc.autocast(recipe=recipe):
        y = lin(x)
    y.backward(g)
    out, dx, dw = linear_reference(x, lin.weight, lin.bias, g, recipe)
    assert_close_to(y, out)
    assert_close_to(x.grad, dx)
    assert_close_to(lin.weight.grad, dw)
    torch.testing.assert_close(lin.bias.grad, matrix(g).sum(0))


def test_high_precision_wgrad_is_nn_linears_and_the_plain_one_is_not():
    """The high-precision weight gradient is exactly nn.Linear's (FP32 here, and bf16
    under torch.autocast, with the same output gradient); the plain recipe's differs."""
    torch.manual_seed(20)
    lin = fc.Linear(64, 32)
    ref = nn.Linear(64, 32)
    ref.load_state_dict(lin.state_dict(), strict=False)
    x = sample((2, 16, 64), seed=21)
    g = sample((2, 16, 32), seed=22, spread=2)
    for dtype in (None, torch.bfloat16):
        grads = {}
        for name, recipe in (("hp", HP), ("plain", PLAIN)):
            lin.weight.grad = None
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                with fc.autocast(recipe=recipe):
                    y = lin(x)
            y.backward(g.to(y.dtype))
            grads[name] = lin.weight.grad
        ref.weight.grad = None
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            y_ref = ref(x)
        y_ref.backward(g.to(y_ref.dtype))
        assert grads["hp"].dtype == torch.float32
        assert torch.equal(grads["hp"], ref.weight.grad)
        assert not torch.equal(grads["plain"], ref.weight.grad)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_high_precision_wgrad_keeps_the_input_itself_and_the_fp8_weight(x_dtype):
    """What backward keeps: the FP8 weight (dgrad) and the input as it came (wgrad), no
    FP8 copy of the input; the plain recipe keeps FP8 operands only."""
    torch.manual_seed(23)
    lin = fc.Linear(256, 128)
    x = torch.randn(2, 64, 256, dtype=x_dtype, requires_grad=True)
    mixed = torch.autocast("cpu", dtype=x_dtype, enabled=x_dtype != torch.float32)

    def run(recipe):
        def fn():
            with mixed, fc.autocast(recipe=recipe):
                return lin(x)

        return _saved_tensors(fn)

    y, saved = run(HP)
    inputs = [t for t in saved if t.data_ptr() == x.data_ptr()]
    assert len(inputs) == 1 and inputs[0].dtype == x_dtype
    others = [t for t in saved if t.data_ptr() != x.data_ptr()]
    fp8 = [t for t in others if t.dtype == torch.float8_e4m3fn]
    assert [tuple(t.shape) for t in fp8] == [(256, 128)]  # W.T, for dgrad
    assert all(t.numel() <= 256 for t in others if t.dtype != torch.float8_e4m3fn)  # scales
    y.float().sum().backward()
    assert x.grad is not None and lin.weight.grad is not None

    _, saved_plain = run(PLAIN)
    assert {t.dtype for t in saved_plain} == {torch.float8_e4m3fn, torch.float32}
    fp8_plain = sorted(tuple(t.shape) for t in saved_plain if t.dtype == torch.float8_e4m3fn)
    assert fp8_plain == [(256, 128), (256, 128)]  # x.T [K, M] and W.T [K, N]


def test_only_one_gradient_needed():
    """Frozen weight: no wgrad (and nothing of x kept); input without grad: no dgrad."""
    torch.manual_seed(24)
    lin = fc.Linear(64, 32)
    x = sample((32, 64), seed=25)
    g = sample((32, 32), seed=26)
    for recipe in (PLAIN, HP):
        lin.requires_grad_(False)
        xg = x.clone().requires_grad_()
        with fc.autocast(recipe=recipe):
            y, saved = _saved_tensors(lambda: lin(xg))  # noqa: B023
        assert all(t.dtype == torch.float8_e4m3fn or t.numel() <= 64 for t in saved)
        y.backward(g)
        assert_close_to(xg.grad, linear_reference(xg, lin.weight, lin.bias, g, recipe)[1])
        lin.requires_grad_(True)
        lin.weight.grad = lin.bias.grad = None
        with fc.autocast(recipe=recipe):
            y = lin(x)
        y.backward(g)
        assert_close_to(lin.weight.grad, linear_reference(x, lin.weight, lin.bias, g, recipe)[2])


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("recipe", [PLAIN, HP], ids=["rowwise", "rowwise-gw-hp"])
def test_activation_checkpointing_changes_nothing(recipe, reentrant):
    torch.manual_seed(27)
    assert_checkpointing_changes_nothing(recipe, reentrant, torch.randn(3, 7, 64))


@pytest.mark.parametrize("recipe", [PLAIN, HP], ids=["rowwise", "rowwise-gw-hp"])
def test_stateless_checkpoint_round_trip(recipe):
    torch.manual_seed(28)
    lin = fc.Linear(64, 32)
    with fc.autocast(recipe=recipe):
        lin(torch.randn(8, 64, requires_grad=True)).sum().backward()
    state = lin.state_dict()
    assert list(state) == ["weight", "bias"]  # nothing to save: nn.Linear's keys
    fresh = fc.Linear(64, 32)
    assert fresh.load_state_dict(state).missing_keys == []
    x = torch.randn(8, 64)
    with torch.no_grad(), fc.autocast(recipe=recipe):
        assert torch.equal(fresh(x), lin(x))


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("gemm_mode", ["emulate"], indirect=True)
def test_compiled_forward_and_backward_equal_eager_bit_for_bit(gemm_mode):
    """The high-precision-wgrad recipe (per-row input and gradient, per-row and per-tensor
    weight layouts, the unquantized wgrad) under torch.compile(fullgraph=True): output
    and every gradient equal eager's bit for bit. Both emulate the FP8 GEMMs (on the CPU
    compiled code always does), and nothing between the layers rounds (no bias, ReLU)."""
    torch.manual_seed(29)
    model = fc.convert(
        nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 32, bias=False))
    )
    x = sample((48, 64), seed=30)
    g = sample((48, 32), seed=31, spread=3)

    def forward(model, x):
        with fc.autocast(recipe=HP):
            return model(x)

    def step(fn):
        for p in model.parameters():
            p.grad = None
        x_in = x.clone().requires_grad_()
        y = fn(model, x_in)
        y.backward(g)
        return [y.detach(), x_in.grad] + [p.grad for p in model.parameters()]

    eager = step(forward)
    compiled = step(torch.compile(forward, fullgraph=True))
    for got, want in zip(compiled, eager):
        assert got.dtype == want.dtype and torch.equal(got, want)
