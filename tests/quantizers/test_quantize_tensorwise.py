"""Per-tensor FP8 quantizers (current, delayed, fixed scale) against a float64 reference.

The reference never calls fastcast. The scale is ``fmt_max / amax`` evaluated in float64
and rounded once to FP32: double rounding from 53 to 24 bits is innocuous for a single
division (53 >= 2 * 24 + 2), so that is the correctly rounded FP32 quotient. The data is
``round_to_fp8(fp32(x * scale))``: the float64 product of two FP32 values is exact, it is
rounded once to FP32 (what an FP32 multiply does) and then to FP8 by ``fp8_reference``
(grids decoded from the bit layouts, nearest, ties to even, finite values saturating, a
finite product beyond the FP32 range included; infinities stay non-finite).
"""

from __future__ import annotations

import math

import pytest
import torch
from fp8_reference import (
    FMT_MAX,
    FP8,
    FP32_MAX,
    GRIDS,
    assert_codes_equal,
    encode_fp8,
    reference_scale,
    to_f32,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fastcast as fc
from fastcast.quantizers import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    FixedScaleQuantizer,
)
from fastcast.tensor import Float8Tensor

FMTS = ["e4m3", "e5m2"]
# Smallest normal magnitude and half the subnormal step of each format.
MIN_NORMAL = {"e4m3": 2.0**-6, "e5m2": 2.0**-14}
HALF_SUB_STEP = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}
# Largest relative rounding error of a normal value: half an ulp over the smallest
# significand (3 and 2 mantissa bits).
REL_ERR = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


# -- reference ---------------------------------------------------------------------------------
ref_scale = reference_scale  # (fp8_reference.py: the definition, shared)


def ref_amax(x: torch.Tensor) -> float:
    v = x.double()
    if bool(v.isnan().any()):
        return math.nan
    return v.abs().max().item() if v.numel() else 0.0


def ref_codes(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """FP8 codes of ``x * scale`` (FP32 product), shaped like ``x``."""
    product = (x.double() * scale).float().double()
    # A finite value whose FP32 product overflows is still a finite value: it saturates.
    product = torch.where(x.isinf(), product, product.clamp(-FP32_MAX, FP32_MAX))
    return encode_fp8(product, fmt)


def check_quantized(q, x: torch.Tensor, scale: float, fmt: str) -> None:
    """Metadata, bit-exact data and the FP32 scale_inv of a per-tensor quantization."""
    assert isinstance(q, Float8Tensor)
    assert q.fmt == fmt and q.shape == x.shape and q.dtype == x.dtype
    assert q.block == (0, 0)
    assert q.data.shape == x.shape and q.data.dtype == FP8[fmt]
    assert q.scale_inv.dtype == torch.float32 and q.scale_inv.numel() == 1
    assert q.scale_inv.item() == to_f32(1.0 / scale)
    assert_codes_equal(q.data, ref_codes(x, scale, fmt), fmt)


def sample(shape, dtype=torch.float32, seed=0, spread=6):
    """randn with a per-row magnitude 2**k, k in [-spread, spread]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    k = torch.randint(-spread, spread + 1, tuple(shape[:-1]) + (1,), generator=g)
    return (x * torch.pow(2.0, k.double())).to(dtype)


class Meta:
    """What DelayedScalingQuantizer reads: lists of one-element scale and amax tensors."""

    def __init__(self, scales):
        self.scale_views = [torch.tensor([float(s)]) for s in scales]
        self.amax_slots = [torch.zeros(1) for _ in scales]


CASES = {
    "2d-f32": lambda: sample((33, 70), torch.float32, seed=1),
    "2d-bf16": lambda: sample((16, 40), torch.bfloat16, seed=2),
    "2d-f16": lambda: sample((9, 31), torch.float16, seed=3),
    "1d-f32": lambda: sample((257,), torch.float32, seed=4),
    "3d-bf16": lambda: sample((3, 5, 24), torch.bfloat16, seed=5),
    "transposed-f32": lambda: sample((40, 24), torch.float32, seed=6).t(),
    "sliced-f16": lambda: sample((20, 64), torch.float16, seed=7)[3:17, ::3],
    "permuted-3d-f32": lambda: sample((4, 6, 10), torch.float32, seed=8).permute(1, 0, 2),
}


def test_reference_scale_definition():
    assert ref_scale(1.0, "e4m3") == 448.0
    assert ref_scale(3.0, "e4m3") == to_f32(448.0 / 3.0)
    assert ref_scale(3.0, "e4m3", power_2=True) == 128.0
    assert ref_scale(7.0, "e4m3", power_2=True) == 64.0  # 448 / 7 = 64 exactly
    assert ref_scale(0.0, "e5m2") == ref_scale(math.nan, "e5m2") == 1.0
    assert ref_scale(1e-40, "e4m3") == FP32_MAX
    assert ref_scale(1e-40, "e4m3", power_2=True) == 2.0**127


# -- current scaling: numerics -----------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("fmt", FMTS)
def test_current_scaling_matches_reference(case, power_2, fmt):
    x = CASES[case]()
    q = CurrentScalingQuantizer(fmt=fmt, power_2_scales=power_2).quantize(x)
    scale = ref_scale(ref_amax(x), fmt, power_2)
    check_quantized(q, x, scale, fmt)
    assert q.data_t is None and q.scale_inv_t is None
    deq = q.dequantize()
    assert deq.dtype == x.dtype and deq.shape == x.shape


def test_scales_are_correctly_rounded_quotients():
    # Many amaxes over a wide exponent range: the FP32 scale is the correctly rounded
    # fmt_max / amax, never one ulp off (as fmt_max * (1 / amax) would sometimes be).
    g = torch.Generator().manual_seed(10)
    mags = torch.rand(300, generator=g, dtype=torch.float64) + 0.5
    exps = torch.randint(-40, 40, (300,), generator=g).double()
    for fmt in FMTS:
        for amax in (mags * torch.pow(2.0, exps)).float().tolist():
            x = torch.tensor([amax, -amax / 3], dtype=torch.float32)
            q = CurrentScalingQuantizer(fmt=fmt).quantize(x)
            expected = ref_scale(amax, fmt)
            assert q.scale_inv.item() == to_f32(1.0 / expected), (fmt, amax)
            assert_codes_equal(q.data, ref_codes(x, expected, fmt), fmt)


@pytest.mark.parametrize("fmt", FMTS)
def test_amax_epsilon_floors_the_amax(fmt):
    x = torch.tensor([1e-3, -5e-4, 0.0])
    # epsilon above the amax: the scale comes from epsilon
    q = CurrentScalingQuantizer(fmt=fmt, amax_epsilon=0.5).quantize(x)
    check_quantized(q, x, FMT_MAX[fmt] / 0.5, fmt)
    # epsilon below the amax: no effect
    q = CurrentScalingQuantizer(fmt=fmt, amax_epsilon=1e-6).quantize(x)
    check_quantized(q, x, ref_scale(ref_amax(x), fmt), fmt)
    # an all-zero tensor takes its scale from epsilon, not the 1.0 fallback
    zeros = torch.zeros(4, 3)
    q = CurrentScalingQuantizer(fmt=fmt, amax_epsilon=0.25).quantize(zeros)
    check_quantized(q, zeros, FMT_MAX[fmt] / 0.25, fmt)
    # with power-of-2 rounding after the floor: 448 / 0.3 = 1493.3 -> 1024
    q = CurrentScalingQuantizer(fmt=fmt, power_2_scales=True, amax_epsilon=0.3).quantize(x)
    check_quantized(q, x, ref_scale(ref_amax(x), fmt, power_2=True, eps=0.3), fmt)
    if fmt == "e4m3":
        assert q.scale_inv.item() == 2.0**-10


@pytest.mark.parametrize("eps", [0.0, 0.5])
@pytest.mark.parametrize("fmt", FMTS)
def test_zero_nan_and_inf_amax_give_scale_one(fmt, eps):
    quantizer = CurrentScalingQuantizer(fmt=fmt, amax_epsilon=eps)
    zeros = torch.zeros(3, 5)
    q = quantizer.quantize(zeros)
    # an all-zero tensor: epsilon (if any) floors the amax, else the 1.0 fallback
    check_quantized(q, zeros, FMT_MAX[fmt] / eps if eps else 1.0, fmt)

    nan_x = torch.tensor([[1.5, math.nan, -3.0], [0.0, 1e5, -0.25]])
    q = quantizer.quantize(nan_x)
    check_quantized(q, nan_x, 1.0, fmt)  # 1e5 saturates at the element max
    assert bool(q.data.float()[0, 1].isnan())
    assert q.data.float()[1, 1].item() == FMT_MAX[fmt]

    inf_x = torch.tensor([math.inf, -2.0, -math.inf, 0.5])
    q = quantizer.quantize(inf_x)
    check_quantized(q, inf_x, 1.0, fmt)
    # the infinities stay non-finite: inf in E5M2, NaN in E4M3 (which has no inf)
    non_finite = [math.inf, -math.inf] if fmt == "e5m2" else [math.nan, math.nan]
    torch.testing.assert_close(
        q.data.float(), torch.tensor([non_finite[0], -2.0, non_finite[1], 0.5]), equal_nan=True
    )


@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("fmt", FMTS)
def test_tiny_amax_gives_the_fp32_max_scale(fmt, power_2):
    # 1e-40 is an FP32 subnormal: fmt_max / amax overflows FP32 and is capped.
    x = torch.tensor([1e-40, -5e-41, 0.0, 2e-45], dtype=torch.float32)
    assert 0 < x[0].item() < torch.finfo(torch.float32).tiny
    q = CurrentScalingQuantizer(fmt=fmt, power_2_scales=power_2).quantize(x)
    scale = ref_scale(x[0].item(), fmt, power_2)
    assert scale == (2.0**127 if power_2 else FP32_MAX)
    check_quantized(q, x, scale, fmt)
    assert bool(torch.isfinite(q.dequantize()).all())
    # a tiny amax just above the cap gets its exact quotient
    edge = torch.tensor([2e-36, 1e-37])
    q = CurrentScalingQuantizer(fmt=fmt).quantize(edge)
    check_quantized(q, edge, ref_scale(edge[0].item(), fmt), fmt)


@pytest.mark.parametrize("fmt", FMTS)
def test_saturation_with_a_too_large_scale(fmt):
    fmt_max = FMT_MAX[fmt]
    x = torch.tensor([1.0, -1.0, 0.5, -1e-3, 0.0, math.inf, -math.inf, math.nan])
    scale = torch.tensor(fmt_max * 1.5)
    for quantizer in (
        FixedScaleQuantizer(scale, fmt),
        DelayedScalingQuantizer(Meta([fmt_max * 1.5]), 0, fmt),
    ):
        q = quantizer.quantize(x)
        check_quantized(q, x, fmt_max * 1.5, fmt)
        got = q.data.float()
        assert got[:2].tolist() == [fmt_max, -fmt_max]  # clamped, not inf / NaN
        if fmt == "e5m2":  # infinities are not clamped: inf in E5M2, NaN in E4M3
            assert got[5:7].tolist() == [math.inf, -math.inf]
        else:
            assert bool(got[5:7].isnan().all())
        assert bool(got[7].isnan())
        assert got[4].item() == 0.0
    # e5m2 has infinities: a saturating cast must never produce one
    big = torch.tensor([1e30, -1e30])
    q = FixedScaleQuantizer(torch.tensor(1.0), fmt).quantize(big)
    assert q.data.float().tolist() == [fmt_max, -fmt_max]


@pytest.mark.parametrize("fmt", FMTS)
def test_nan_elements_stay_nan_and_zeros_are_exact(fmt):
    x = sample((6, 20), seed=12)
    x[1, 3] = math.nan
    x[4, 0] = math.nan
    x[2, :] = 0.0
    x[3, 5] = -0.0
    for quantizer in (
        FixedScaleQuantizer(torch.tensor(8.0), fmt),
        DelayedScalingQuantizer(Meta([8.0]), 0, fmt),
    ):
        q = quantizer.quantize(x)
        check_quantized(q, x, 8.0, fmt)
        deq = q.dequantize()
        assert torch.equal(deq.isnan(), x.isnan())
        assert bool((deq[2] == 0).all())
        assert torch.signbit(deq[3, 5]) and deq[3, 5].item() == 0.0
    q = CurrentScalingQuantizer(fmt=fmt).quantize(x)  # NaN amax: scale 1.0
    check_quantized(q, x, 1.0, fmt)
    assert torch.equal(q.dequantize().isnan(), x.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FMTS)
def test_representable_values_round_trip_exactly(fmt, dtype):
    grid = GRIDS[fmt]
    values = torch.cat((grid, -grid))
    if dtype == torch.float16:  # float16 cannot hold e5m2's smallest subnormals scaled down
        values = values[values.abs() >= 2.0**-14]
    # amax = fmt_max / 2**4, so the scale is 16 exactly and every value stays on the grid
    x = (values / 16).to(dtype)
    assert torch.equal(x.double(), values / 16)
    for quantizer in (
        CurrentScalingQuantizer(fmt=fmt),
        CurrentScalingQuantizer(fmt=fmt, power_2_scales=True),
        FixedScaleQuantizer(torch.tensor(16.0), fmt),
    ):
        q = quantizer.quantize(x)
        assert q.scale_inv.item() == 1 / 16
        assert torch.equal(q.data.double(), values)
        assert torch.equal(q.dequantize(), x)
        assert torch.equal(q.dequantize(torch.float64), values / 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FMTS)
def test_relative_error_of_normal_values(fmt, dtype):
    x = sample((64, 48), dtype, seed=13, spread=3)
    q = CurrentScalingQuantizer(fmt=fmt).quantize(x)
    scale = ref_scale(ref_amax(x), fmt)
    scaled = (x.double() * scale).float().double()
    normal = scaled.abs() >= MIN_NORMAL[fmt]
    assert int(normal.sum()) > x.numel() // 2
    fp8 = q.data.double()
    rel = ((fp8 - scaled).abs() / scaled.abs())[normal]
    assert float(rel.max()) < REL_ERR[fmt]
    # the same bound after dequantization, up to the FP32 roundings of 1/scale and product
    deq = q.dequantize(torch.float32).double()
    rel_deq = ((deq - x.double()).abs() / x.double().abs())[normal]
    assert float(rel_deq.max()) < REL_ERR[fmt] * (1 + 2.0**-20)


# -- layouts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["2d-f32", "3d-bf16", "1d-f32", "transposed-f32", "sliced-f16"])
@pytest.mark.parametrize("fmt", FMTS)
def test_columnwise_is_the_transposed_rowwise_data(case, fmt):
    x = CASES[case]()
    quantizer = CurrentScalingQuantizer(fmt=fmt)
    q = quantizer.quantize(x, rowwise=True, columnwise=True)
    scale = ref_scale(ref_amax(x), fmt)
    check_quantized(q, x, scale, fmt)
    rows = x.numel() // x.shape[-1]
    assert q.block_t == (0, 0)
    assert q.data_t.shape == (x.shape[-1], rows)
    as_bytes = q.data.reshape(rows, -1).view(torch.uint8)
    assert torch.equal(q.data_t.view(torch.uint8), as_bytes.t())
    assert torch.equal(q.scale_inv_t, q.scale_inv)
    codes = ref_codes(x.reshape(rows, -1), scale, fmt)
    assert_codes_equal(q.data_t, codes.t(), fmt)

    only_t = quantizer.quantize(x, rowwise=False, columnwise=True)
    assert only_t.data is None and not only_t.has_rowwise
    assert_codes_equal(only_t.data_t, codes.t(), fmt)
    assert torch.equal(only_t.scale_inv_t, q.scale_inv)
    assert torch.equal(only_t.dequantize(), q.dequantize())


def test_columnwise_only_has_no_rowwise_scale():
    x = sample((8, 16), seed=19)
    q = CurrentScalingQuantizer().quantize(x, rowwise=False, columnwise=True)
    assert q.data is None
    assert q.scale_inv is None
    assert q.__tensor_flatten__()[0] == ["data_t", "scale_inv_t"]


def test_scale_inv_is_a_fresh_tensor():
    x = sample((8, 16), seed=14)
    scale = torch.tensor(4.0)
    q = FixedScaleQuantizer(scale, "e4m3").quantize(x, columnwise=True)
    scale.mul_(2)
    assert q.scale_inv.item() == 0.25 and q.scale_inv_t.item() == 0.25
    fresh = FixedScaleQuantizer(torch.tensor(4.0), "e4m3").quantize(x)
    assert torch.equal(q.dequantize(), fresh.dequantize())

    meta = Meta([2.0])
    quantizer = DelayedScalingQuantizer(meta, 0, "e4m3")
    q = quantizer.quantize(x)
    before = q.dequantize()
    meta.scale_views[0].fill_(64.0)  # the next scale update, in place
    assert q.scale_inv.item() == 0.5
    assert torch.equal(q.dequantize(), before)
    assert q.scale_inv.untyped_storage().data_ptr() != meta.scale_views[0].data_ptr()
    check_quantized(quantizer.quantize(x), x, 64.0, "e4m3")  # later calls see the new scale

    current = CurrentScalingQuantizer()
    a, b = current.quantize(x), current.quantize(x)
    a.scale_inv.mul_(3)
    assert b.scale_inv.item() == to_f32(1.0 / ref_scale(ref_amax(x), "e4m3"))


# -- delayed and fixed scaling -----------------------------------------------------------------
@pytest.mark.parametrize("fmt", FMTS)
def test_delayed_scaling_quantizes_and_records_amax(fmt):
    meta = Meta([1.0, 32.0, 0.5])
    quantizer = DelayedScalingQuantizer(meta, 1, fmt)
    assert quantizer.fmt == fmt and quantizer.recording
    assert quantizer.scale is meta.scale_views[1]

    x = sample((10, 12), seed=15, spread=2)
    q = quantizer.quantize(x, columnwise=True)
    check_quantized(q, x, 32.0, fmt)
    assert meta.amax_slots[1].item() == to_f32(ref_amax(x))
    assert meta.amax_slots[0].item() == meta.amax_slots[2].item() == 0.0

    # max-accumulating: a smaller amax keeps the slot, a larger one raises it
    quantizer.quantize(x / 4)
    assert meta.amax_slots[1].item() == to_f32(ref_amax(x))
    bigger = x * 3
    quantizer.quantize(bigger.to(torch.bfloat16))
    assert meta.amax_slots[1].item() == to_f32(ref_amax(bigger.to(torch.bfloat16)))

    # not recording: quantizes with the scale, leaves the slot alone
    quantizer.recording = False
    before = meta.amax_slots[1].clone()
    q = quantizer.quantize(x * 100)
    check_quantized(q, x * 100, 32.0, fmt)
    assert torch.equal(meta.amax_slots[1], before)

    # the views are looked up per call (the registry may re-point them)
    meta.scale_views[1] = torch.tensor([2.0])
    check_quantized(quantizer.quantize(x), x, 2.0, fmt)


def test_delayed_scaling_records_finite_amaxes_only():
    meta = Meta([4.0])
    quantizer = DelayedScalingQuantizer(meta, 0)
    quantizer.quantize(torch.ones(3, 4))
    # A non-finite amax records nothing (it would freeze the scale for the whole history
    # window); the NaN itself stays in the quantized data.
    x = torch.tensor([[1.0, math.nan], [2.0, 3.0]])
    q = quantizer.quantize(x)
    assert meta.amax_slots[0].item() == 1.0
    check_quantized(q, x, 4.0, "e4m3")
    quantizer.quantize(torch.tensor([[5.0, -math.inf]]))
    assert meta.amax_slots[0].item() == 1.0
    quantizer.quantize(torch.full((2, 2), 1e3))  # later finite amaxes still count
    assert meta.amax_slots[0].item() == 1e3


def test_delayed_scaling_slot_of_zero_dim():
    meta = Meta([1.0])
    meta.amax_slots[0] = torch.zeros(())
    DelayedScalingQuantizer(meta, 0).quantize(torch.tensor([-7.5, 2.0]))
    assert meta.amax_slots[0].shape == () and meta.amax_slots[0].item() == 7.5


def test_fixed_scale_quantizes_empty_tensors():
    for shape in [(0, 16), (4, 0), (2, 0, 8)]:
        q = FixedScaleQuantizer(torch.tensor(2.0), "e4m3").quantize(
            torch.empty(shape), columnwise=True
        )
        assert q.shape == shape and q.data.shape == shape
        assert q.dequantize().shape == shape


@pytest.mark.parametrize("shape", [(0, 16), (4, 0), (2, 0, 8)])
def test_current_scaling_quantizes_empty_tensors(shape):
    q = CurrentScalingQuantizer().quantize(torch.empty(shape), columnwise=True)
    assert q.shape == shape and q.data.shape == shape
    assert q.scale_inv.item() == 1.0
    assert q.dequantize().shape == shape


def test_delayed_scaling_quantizes_empty_tensors():
    meta = Meta([4.0])
    meta.amax_slots[0].fill_(3.0)
    q = DelayedScalingQuantizer(meta, 0).quantize(torch.empty(0, 16))
    assert q.data.shape == (0, 16) and q.scale_inv.item() == 0.25
    assert meta.amax_slots[0].item() == 3.0  # max with an empty amax (0) changes nothing


def test_fixed_scale_records_nothing_and_uses_its_scale():
    x = sample((5, 7), torch.bfloat16, seed=16)
    q = FixedScaleQuantizer(torch.tensor(0.75), "e5m2").quantize(x, columnwise=True)
    check_quantized(q, x, 0.75, "e5m2")
    assert q.data_t is not None


# -- input checks ------------------------------------------------------------------------------
QUANTIZERS = {
    "current": lambda: CurrentScalingQuantizer(),
    "delayed": lambda: DelayedScalingQuantizer(Meta([1.0]), 0),
    "fixed": lambda: FixedScaleQuantizer(torch.tensor(1.0), "e4m3"),
}


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_bad_inputs(kind):
    quantizer = QUANTIZERS[kind]()
    for bad in (
        torch.arange(6).reshape(2, 3),
        torch.ones(2, 3, dtype=torch.int8),
        torch.ones(2, 3, dtype=torch.bool),
        torch.ones(2, 3).to(torch.float8_e4m3fn),
    ):
        with pytest.raises(TypeError, match=str(bad.dtype).removeprefix("torch.")):
            quantizer.quantize(bad)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantizer.quantize([1.0, 2.0])
    with pytest.raises(ValueError, match="dimension"):
        quantizer.quantize(torch.tensor(3.0))


def test_bad_formats():
    with pytest.raises(ValueError, match="e4m3 or e5m2"):
        CurrentScalingQuantizer(fmt="e2m1")
    with pytest.raises(ValueError, match="e4m3 or e5m2"):
        DelayedScalingQuantizer(Meta([1.0]), 0, fmt="fp8")


# -- fc.quantize -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "role, fmt_name",
    [("input", "fwd"), ("weight", "fwd"), ("grad_output", "bwd")],
)
@pytest.mark.parametrize("fmt", [fc.Format.HYBRID, fc.Format.E4M3])
def test_fc_quantize_current_scaling(role, fmt_name, fmt):
    x = sample((12, 20), torch.bfloat16, seed=17)
    recipe = fc.Float8CurrentScaling(fp8_format=fmt)
    element = getattr(fmt, fmt_name)
    q = fc.quantize(x, recipe, role)
    check_quantized(q, x, ref_scale(ref_amax(x), element), element)
    assert torch.equal(q.dequantize().isnan(), x.isnan())

    recipe = fc.Float8CurrentScaling(fp8_format=fmt, use_power_2_scales=True, amax_epsilon=40.0)
    q = fc.quantize(x, recipe, role, columnwise=True)
    scale = ref_scale(ref_amax(x), element, power_2=True, eps=40.0)
    check_quantized(q, x, scale, element)
    assert q.data_t is not None


def test_fc_quantize_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="stateful"):
        fc.quantize(x, fc.DelayedScaling())
    with pytest.raises(ValueError, match="role"):
        fc.quantize(x, fc.Float8CurrentScaling(), role="bias")
    with pytest.raises(TypeError, match="quantize"):
        fc.quantize(x, fc.CustomRecipe(lambda role: object()))
    with pytest.raises(TypeError, match="recipe"):
        fc.quantize(x, "fp8")


def test_fc_quantize_custom_recipe():
    roles = []

    def qfactory(role):
        roles.append(role)
        return FixedScaleQuantizer(torch.tensor(8.0), "e5m2" if role == "grad_output" else "e4m3")

    recipe = fc.CustomRecipe(qfactory)
    x = sample((6, 10), seed=18)
    q = fc.quantize(x, recipe, "weight", columnwise=True)
    check_quantized(q, x, 8.0, "e4m3")
    assert q.data_t is not None
    q = fc.quantize(x, recipe, "grad_output")
    check_quantized(q, x, 8.0, "e5m2")
    assert roles == ["weight", "grad_output"]


# -- property ----------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    exponent=st.integers(-30, 30),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fmt=st.sampled_from(FMTS),
    power_2=st.booleans(),
    columnwise=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_dequantize_error_bound(shape, exponent, dtype, fmt, power_2, columnwise, seed):
    if dtype == torch.float16:
        exponent = max(-8, min(8, exponent))
    x = (sample(tuple(shape), torch.float64, seed=seed, spread=4) * 2.0**exponent).to(dtype)
    q = CurrentScalingQuantizer(fmt=fmt, power_2_scales=power_2).quantize(x, columnwise=columnwise)
    scale = ref_scale(ref_amax(x), fmt, power_2)
    check_quantized(q, x, scale, fmt)
    # every value is within half an FP8 ulp of its scaled self (relative for normals,
    # absolute half a subnormal step below), plus FP32 rounding slack
    xd = x.double()
    bound = torch.maximum(xd.abs() * REL_ERR[fmt], torch.tensor(HALF_SUB_STEP[fmt] / scale))
    err = (q.dequantize(torch.float32).double() - xd).abs()
    assert bool((err <= bound * (1 + 2.0**-20)).all()), float((err / bound).max())
