"""Non-finite values through every quantizer, and GradScaler's overflow check end to end.

The rule: a non-finite input stays non-finite through quantize + dequantize (+-inf stays
+-inf where the element format has an infinity, E5M2; it becomes NaN in E4M3, which has
none; NaN stays NaN), and only finite values beyond the range saturate to +-max. For
NVFP4 (E2M1 elements, E4M3 block scales: no infinity anywhere) the whole 16-element block
holding a non-finite value dequantizes to NaN, through a NaN block scale.

The scale of a tensor or tile holding an inf or NaN follows the existing fallbacks:
current scaling and block tiles use 1.0, delayed scaling its scale from earlier steps;
MXFP8 leaves non-finite elements out of the block amax, NVFP4 out of the tensor amax. Every
element elsewhere is quantized exactly as it is without the non-finite value.

Delayed-scaling state is per thread, so the training tests run in a fresh
``contextvars.Context`` (see ``test_linear_delayed.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
from _contexts import isolated
from fp8_reference import FMT_MAX, FP32_MAX, assert_codes_equal, encode_fp8
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fastcast as fc
from fastcast.kernels import choice
from fastcast.quantizers import (
    BlockScalingQuantizer,
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    RowwiseQuantizer,
)

FMTS = ["e4m3", "e5m2"]
LAYOUTS = ["rowwise", "columnwise"]
SHAPE = (64, 128)  # every family's constraints: K % 32, R % 32 (MX column-wise), R % 16
DELAYED_SCALE = 4.0  # a power of two: x * scale is exact, so the reference is simple


class Meta:
    """What DelayedScalingQuantizer reads: one-element scale views and amax slots."""

    def __init__(self, scale: float) -> None:
        self.scale_views = [torch.tensor([scale])]
        self.amax_slots = [torch.zeros(1)]


FACTORIES = {
    "current": lambda fmt: CurrentScalingQuantizer(fmt=fmt),
    "delayed": lambda fmt: DelayedScalingQuantizer(Meta(DELAYED_SCALE), 0, fmt),
    "block1x128": lambda fmt: BlockScalingQuantizer(fmt=fmt, block_dim=1),
    "block128x128": lambda fmt: BlockScalingQuantizer(fmt=fmt, block_dim=2),
    "mxfp8-rceil": lambda fmt: MXFP8Quantizer(fmt=fmt, scale_rule="rceil"),
    "mxfp8-ocp": lambda fmt: MXFP8Quantizer(fmt=fmt, scale_rule="ocp"),
    "rowwise": lambda fmt: RowwiseQuantizer(fmt=fmt),
    "rowwise-t-per-tensor": lambda fmt: RowwiseQuantizer(fmt=fmt, columnwise_per_tensor=True),
}
NVFP4 = {
    "nvfp4-1x16": lambda: NVFP4Quantizer(),
    "nvfp4-16x16": lambda: NVFP4Quantizer(block_2d=True),
}


def sample(shape=SHAPE, seed=0, dtype=torch.float32) -> torch.Tensor:
    """Finite values with a per-row magnitude 2**k, k in [-4, 4]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    k = torch.randint(-4, 5, (shape[0], 1), generator=g).float()
    return (x * torch.pow(2.0, k)).to(dtype)


def with_specials(x: torch.Tensor, positions: dict[tuple[int, int], float]) -> torch.Tensor:
    x = x.clone()
    for (r, c), v in positions.items():
        x[r, c] = v
    return x


SPECIALS = {(0, 0): math.inf, (5, 77): -math.inf, (40, 3): math.nan, (63, 127): math.inf}


def quantize(quantizer, x: torch.Tensor, layout: str):
    return quantizer.quantize(x, rowwise=layout == "rowwise", columnwise=layout == "columnwise")


def dequantized(q) -> torch.Tensor:
    """The dequantized tensor of whichever layout ``q`` holds, shaped like the input."""
    return q.dequantize(torch.float32)


def layout_data(q, layout: str) -> torch.Tensor:
    """The FP8 data of one layout, oriented like the input ``[R, K]``."""
    return q.data if layout == "rowwise" else q.data_t.t()


def assert_non_finite_where_the_input_is(deq: torch.Tensor, x: torch.Tensor, fmt: str):
    """Exactly the non-finite inputs are non-finite: inf stays +-inf in E5M2 (same sign)
    and becomes NaN in E4M3; NaN stays NaN; everything else is finite."""
    assert torch.equal(~deq.isfinite(), ~x.isfinite())
    assert torch.equal(deq.isnan(), x.isnan() if fmt == "e5m2" else ~x.isfinite())
    inf = x.isinf()
    if fmt == "e5m2":
        assert torch.equal(deq[inf], x[inf].float())


def nvfp4_poisoned_blocks(x: torch.Tensor, quantizer: NVFP4Quantizer, layout: str):
    """Mask of the elements whose 16-block (1x16 along the scaled dim, or 16x16 tile)
    holds a non-finite input."""
    bad = ~x.isfinite()
    rows, cols = bad.shape
    if quantizer.block_2d:
        tiles = bad.reshape(rows // 16, 16, cols // 16, 16).any(dim=(1, 3))
        return tiles.repeat_interleave(16, 0).repeat_interleave(16, 1)
    if layout == "rowwise":  # blocks of 16 along K
        return bad.reshape(rows, cols // 16, 16).any(-1).repeat_interleave(16, 1)
    # column-wise: blocks of 16 along R
    return bad.t().reshape(cols, rows // 16, 16).any(-1).repeat_interleave(16, 1).t()


# -- the rule, family by family ---------------------------------------------------------------
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("family", list(FACTORIES))
def test_fp8_non_finite_exactly_where_the_input_is(family, fmt, layout, contiguous):
    clean = sample(seed=1) if contiguous else sample(SHAPE[::-1], seed=1).t()
    x = with_specials(clean, SPECIALS)
    assert x.is_contiguous() == contiguous
    q = quantize(FACTORIES[family](fmt), x, layout)
    assert_non_finite_where_the_input_is(dequantized(q), x, fmt)
    data = layout_data(q, layout).float()
    assert torch.equal(~data.isfinite(), ~x.isfinite())  # in the FP8 data already


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", list(NVFP4))
def test_nvfp4_non_finite_poisons_its_block_only(family, layout):
    quantizer = NVFP4[family]()
    x = with_specials(sample(seed=2), SPECIALS)
    q = quantize(quantizer, x, layout)
    deq = dequantized(q)
    poisoned = nvfp4_poisoned_blocks(x, quantizer, layout)
    assert poisoned.sum() < x.numel() // 4  # the test means something
    # The whole block is NaN (neither E2M1 nor the E4M3 block scale has an infinity).
    assert torch.equal(deq.isnan(), poisoned)
    assert bool(deq[~poisoned].isfinite().all())
    scales = q.scale_inv if layout == "rowwise" else q.scale_inv_t
    assert bool(scales.float().isnan().any())  # through a NaN block scale
    # the tensor amax leaves the non-finite elements out
    finite_amax = x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().max()
    assert q.global_scale_inv.item() == (6.0 * 448 / finite_amax).reciprocal().item()


# -- saturation of finite values ----------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_delayed_stale_scale_saturates_finite_values_only(fmt, layout):
    """Against the definition: codes of fp32(x * scale) (float64 reference), finite values
    saturating, the FP32 overflow of a finite product included; infinities not."""
    fmt_max = FMT_MAX[fmt]
    x = sample(seed=3) * 4
    x[1, :6] = torch.tensor([1e6, -1e6, 3e38, -3e38, math.inf, -math.inf])  # 3e38 * 4: FP32 inf
    x[2, 0] = math.nan
    q = quantize(FACTORIES["delayed"](fmt), x, layout)
    data = layout_data(q, layout)
    product = x.double() * DELAYED_SCALE  # exact: a power of two
    product = torch.where(x.isinf(), product, product.clamp(-FP32_MAX, FP32_MAX))
    assert_codes_equal(data.contiguous(), encode_fp8(product, fmt), fmt)
    deq = dequantized(q)
    scale_inv = 1 / DELAYED_SCALE
    assert deq[1, :4].tolist() == [s * fmt_max * scale_inv for s in (1, -1, 1, -1)]
    assert_non_finite_where_the_input_is(deq, x, fmt)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_current_scaling_with_an_inf_falls_back_to_scale_one(fmt, layout):
    fmt_max = FMT_MAX[fmt]
    clean = sample(seed=4)
    clean[7, 9], clean[8, 10] = 1e6, -1e6  # finite values beyond the range at scale 1
    x = with_specials(clean, {(3, 3): -math.inf})
    q = quantize(FACTORIES["current"](fmt), x, layout)
    assert (q.scale_inv if layout == "rowwise" else q.scale_inv_t).item() == 1.0
    data = layout_data(q, layout)
    assert_codes_equal(data.contiguous(), encode_fp8(x.double(), fmt), fmt)  # scale 1
    deq = dequantized(q)
    assert deq[7, 9].item() == fmt_max and deq[8, 10].item() == -fmt_max
    assert_non_finite_where_the_input_is(deq, x, fmt)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block_dim", [1, 2])
def test_block_tile_with_an_inf_has_scale_one_and_others_are_unchanged(block_dim, fmt, layout):
    fmt_max = FMT_MAX[fmt]
    clean = sample(seed=5)
    clean[10, 20] = 1e6  # finite, beyond the range once the tile falls back to scale 1
    x = with_specials(clean, {(10, 21): math.inf})
    quantizer = BlockScalingQuantizer(fmt=fmt, block_dim=block_dim)
    q, ref = quantize(quantizer, x, layout), quantize(quantizer, clean, layout)
    # the tiles holding (10, 21): as the other elements there, in the layout's orientation
    tile = torch.zeros(SHAPE, dtype=torch.bool)
    if block_dim == 2:
        tile[:64, :128] = True
    elif layout == "rowwise":
        tile[10, :128] = True
    else:
        tile[:64, 21] = True
    data, ref_data = layout_data(q, layout), layout_data(ref, layout)
    assert_codes_equal(data[~tile].contiguous(), ref_data[~tile].view(torch.uint8), fmt)
    assert_codes_equal(data[tile].contiguous(), encode_fp8(x[tile].double(), fmt), fmt)
    deq = dequantized(q)
    if block_dim == 1 and layout == "columnwise":  # 1e6 is in another column's tile
        assert deq[10, 20].item() == dequantized(ref)[10, 20].item()
    else:
        assert deq[10, 20].item() == fmt_max  # saturated at scale 1
    assert_non_finite_where_the_input_is(deq, x, fmt)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", ["rceil", "ocp"])
def test_mxfp8_infinity_is_left_out_of_the_amax(rule, fmt, layout):
    clean = sample(seed=6)
    x = with_specials(clean, SPECIALS)
    quantizer = MXFP8Quantizer(fmt=fmt, scale_rule=rule)
    q = quantize(quantizer, x, layout)
    # the same as the tensor with zeros in place of the non-finite values
    ref = quantize(quantizer, torch.where(x.isfinite(), x, 0.0), layout)
    name = "scale_inv" if layout == "rowwise" else "scale_inv_t"
    assert torch.equal(getattr(q, name), getattr(ref, name))
    finite = x.isfinite()
    data, ref_data = layout_data(q, layout), layout_data(ref, layout)
    assert torch.equal(data.view(torch.uint8)[finite], ref_data.view(torch.uint8)[finite])
    assert_non_finite_where_the_input_is(dequantized(q), x, fmt)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", list(NVFP4))
def test_nvfp4_other_blocks_are_unchanged(family, layout):
    quantizer = NVFP4[family]()
    clean = sample(seed=7)
    x = with_specials(clean, {(3, 40): math.inf, (20, 100): -math.inf})
    poisoned = nvfp4_poisoned_blocks(x, quantizer, layout)
    # The tensor amax leaves the non-finite elements out: every other block quantizes as
    # in the same tensor with zeros in place of the infinities.
    ref_input = torch.where(x.isfinite(), x, 0.0)
    q, ref = quantize(quantizer, x, layout), quantize(quantizer, ref_input, layout)
    assert q.global_scale_inv.item() == ref.global_scale_inv.item() != 1.0
    deq, ref_deq = dequantized(q), dequantized(ref)
    assert torch.equal(deq[~poisoned], ref_deq[~poisoned])
    assert bool(deq[poisoned].isnan().all())


# -- finite values near the FP32 max: finite after quantize -> dequantize ------------------------
NEAR_MAX_FACTORIES = {
    **FACTORIES,
    "current-power-2": lambda fmt: CurrentScalingQuantizer(fmt=fmt, power_2_scales=True),
    "block1x128-fp32-scales": lambda fmt: BlockScalingQuantizer(fmt, 1, power_2_scales=False),
    "block128x128-fp32-scales": lambda fmt: BlockScalingQuantizer(fmt, 2, power_2_scales=False),
    "rowwise-fp32-scales": lambda fmt: RowwiseQuantizer(fmt=fmt, power_2_scales=False),
}


def near_max_sample(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample()`` with huge finite values of both signs across the top binades of
    ``dtype`` (its max included) in rows 0-1 and column 5: every family's tiles, rows,
    columns and blocks meet some. Returns the input and the mask of the huge values."""
    top = float(torch.finfo(dtype).max)
    x = sample(dtype=torch.float64)
    huge = torch.zeros(SHAPE, dtype=torch.bool)
    huge[:2] = True
    huge[:, 5] = True
    g = torch.Generator().manual_seed(8)
    magnitudes = top * (1 - 0.75 * torch.rand(SHAPE, generator=g, dtype=torch.float64))
    magnitudes[0, :4] = top
    signs = torch.where(torch.rand(SHAPE, generator=g) < 0.5, -1.0, 1.0).double()
    x = torch.where(huge, signs * magnitudes, x).to(dtype)
    assert bool(x.isfinite().all()) and x.abs().max().item() == top
    return x, huge


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("family", list(NEAR_MAX_FACTORIES) + list(NVFP4))
def test_finite_values_near_the_fp32_max_stay_finite(
    family, fmt, layout, dtype, kernels, monkeypatch
):
    """A finite input, however close to the FP32 (or BF16) max, dequantizes to a finite
    value of its sign, saturating at worst: against the float64 input, the error of a
    huge value is at most a quarter of it where the scales come from the tensor itself
    (the widest saturation: E4M3 with a power-of-two scale keeps 448 * 2**119, 0.78 of
    the FP32 max). The fused operators (``auto``) and the PyTorch reference, which the
    compiled forms run, both."""
    if family in NVFP4 and fmt == "e5m2":
        pytest.skip("NVFP4 has one element format")
    monkeypatch.setenv("FASTCAST_KERNELS", kernels)
    choice.refresh()
    try:
        x, huge = near_max_sample(dtype)
        quantizer = NVFP4[family]() if family in NVFP4 else NEAR_MAX_FACTORIES[family](fmt)
        q = quantize(quantizer, x, layout)
        deq = q.dequantize(torch.float32).double()
        back = q.dequantize()  # in the input's dtype
    finally:
        monkeypatch.undo()
        choice.refresh()
    assert bool(deq.isfinite().all()), f"{int((~deq.isfinite()).sum())} finite inputs became inf"
    assert bool(back.isfinite().all())
    expected = x.double()[huge]
    assert torch.equal(torch.sign(deq[huge]), torch.sign(expected))
    if family != "delayed":  # (its stale scale, 4, saturates everything at 448 / 4)
        rel = ((deq[huge] - expected).abs() / expected.abs()).max().item()
        assert rel <= 0.25, rel


# -- property: random finite tensors, random non-finite positions -------------------------------
@settings(max_examples=60, deadline=None)
@given(
    family=st.sampled_from(list(FACTORIES) + list(NVFP4)),
    fmt=st.sampled_from(FMTS),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    transposed=st.booleans(),
    specials=st.lists(
        st.tuples(
            st.integers(0, SHAPE[0] - 1),
            st.integers(0, SHAPE[1] - 1),
            st.sampled_from([math.inf, -math.inf, math.nan]),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_property_non_finite_stays_non_finite(
    family, fmt, layout, dtype, transposed, specials, seed
):
    if transposed:  # a non-contiguous input of the same shape
        clean = sample(SHAPE[::-1], seed=seed, dtype=dtype).t()
    else:
        clean = sample(seed=seed, dtype=dtype)
    x = with_specials(clean, {(r, c): v for r, c, v in specials})
    if family in NVFP4:
        quantizer = NVFP4[family]()
        deq = dequantized(quantize(quantizer, x, layout))
        poisoned = nvfp4_poisoned_blocks(x, quantizer, layout)
        assert torch.equal(deq.isnan(), poisoned)
        assert bool(deq[~poisoned].isfinite().all())
        return
    quantizer = FACTORIES[family](fmt)
    q = quantize(quantizer, x, layout)
    assert_non_finite_where_the_input_is(dequantized(q), x, fmt)
    if family == "delayed" or family.startswith("mxfp8"):
        # Scales unaffected (delayed), or the non-finite values count as zeros (MXFP8):
        # every finite element is quantized as without them.
        replaced = torch.where(x.isfinite(), x, torch.zeros((), dtype=dtype))
        ref = quantize(FACTORIES[family](fmt), replaced, layout)
        finite = x.isfinite()
        got = layout_data(q, layout).view(torch.uint8)[finite]
        assert torch.equal(got, layout_data(ref, layout).view(torch.uint8)[finite])
    if family == "rowwise":
        # A row of the layout without a non-finite value is quantized as without them.
        replaced = torch.where(x.isfinite(), x, torch.zeros((), dtype=dtype))
        ref = quantize(FACTORIES[family](fmt), replaced, layout)
        along = 1 if layout == "rowwise" else 0  # the dim each scale runs along
        clean_rows = x.isfinite().all(dim=along, keepdim=True).expand_as(x)
        got = layout_data(q, layout).view(torch.uint8)[clean_rows]
        assert torch.equal(got, layout_data(ref, layout).view(torch.uint8)[clean_rows])


# -- end to end: torch.amp.GradScaler sees the overflow ----------------------------------------
E5M2_MAX = 57344.0
RECIPES = {
    "current": fc.Float8CurrentScaling,
    "delayed": fc.DelayedScaling,
    "block": fc.Float8BlockScaling,
    "mxfp8": fc.MXFP8BlockScaling,
    "nvfp4": fc.NVFP4BlockScaling,
    "rowwise": fc.Float8RowwiseScaling,
    "rowwise-gw-hp": lambda: fc.Float8RowwiseScaling(wgrad_high_precision=True),
}


def make_model(bias: bool, use_fastcast: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32, bias=bias), nn.ReLU(), nn.Linear(32, 32, bias=bias))
    return fc.convert(model) if use_fastcast else model


def train_step(model, opt, scaler, recipe, x, target):
    """One fp16-autocast step with loss scaling; returns whether the weights moved."""
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        if recipe is None:
            out = model(x)
        else:
            with fc.autocast(recipe=recipe):
                out = model(x)
        loss = nn.functional.mse_loss(out.float(), target)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def inputs(overflow: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 32, generator=g)  # 32 rows: MXFP8's column-wise blocks need them
    # mse gradient 2 * (out - t) / 1024 times the loss scale 65536: |out - t| ~ 1e3 makes
    # it overflow FP16 (65504) on its way into the output layer's backward.
    target = torch.randn(32, 32, generator=g) * (1e3 if overflow else 1.0)
    return x, target


def overflow_step(recipe, bias: bool):
    """An overflowing step from a fresh model; (model, scaler, opt, weights moved)."""
    model = make_model(bias, use_fastcast=recipe is not None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.get_scale() == 65536.0
    moved = train_step(model, opt, scaler, recipe, *inputs(overflow=True))
    return model, opt, scaler, moved


def test_gradscaler_skips_an_overflowing_step_without_fastcast():
    """The behaviour fastcast must keep: the step is skipped and the scale halves."""
    for bias in (True, False):
        _, _, scaler, moved = overflow_step(None, bias)
        assert not moved and scaler.get_scale() == 32768.0


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gradscaler_skips_an_overflowing_step(recipe, bias):
    """Without the fix the FP16 inf in the output gradient was clamped to the E5M2 max:
    finite weight gradients, the step applied, the scale kept at 65536 (with biases, only
    their unquantized gradient still showed the overflow)."""

    def body():
        model, _, scaler, moved = overflow_step(RECIPES[recipe](), bias)
        # every gradient, the weights' (computed from quantized operands) included
        assert all(not bool(p.grad.isfinite().all()) for p in model.parameters())
        assert not moved
        assert scaler.get_scale() == 32768.0

    isolated(body)


@pytest.mark.parametrize("gemm_mode", ["emulate", "auto"], indirect=True)
def test_gradscaler_skips_with_either_gemm_path(gemm_mode):
    """The per-tensor GEMM runs through torch._scaled_mm on the CPU ("auto") or emulated:
    both carry the infinities through."""

    def body():
        model, _, scaler, moved = overflow_step(fc.Float8CurrentScaling(), bias=False)
        assert not moved and scaler.get_scale() == 32768.0

    isolated(body)


def test_delayed_backward_scale_recovers_after_an_overflow():
    """One overflow must not freeze the gradient scale for amax_history_len steps: the
    next normal step's amax sets it (without the fix: 1.0 for 1024 steps)."""

    def body():
        model, opt, scaler, moved = overflow_step(fc.DelayedScaling(), bias=True)
        assert not moved
        linears = [m for m in model if isinstance(m, fc.Linear)]
        bwd = [lin._scheme_state[1].scale for lin in linears]
        # the overflowing step records no backward amax: the scale stays where it was
        assert [s.item() for s in bwd] == [1.0, 1.0]

        grads: dict[int, torch.Tensor] = {}  # each layer's output gradient

        def keep_grad_output(module, args, out):
            index = linears.index(module)
            out.register_hook(lambda g: grads.__setitem__(index, g.detach().clone()))

        for lin in linears:
            lin.register_forward_hook(keep_grad_output)
        assert train_step(model, opt, scaler, fc.DelayedScaling(), *inputs(overflow=False))
        assert scaler.get_scale() == 32768.0  # no overflow this time: the step is taken
        for i, lin in enumerate(linears):
            scale = lin._scheme_state[1].scale
            amax = grads[i].double().abs().max().item()
            expected = torch.tensor([E5M2_MAX / amax], dtype=torch.float32)
            assert math.isfinite(scale.item()) and scale.item() != 1.0  # not stuck
            torch.testing.assert_close(scale, expected, rtol=3e-7, atol=0)

    isolated(body)
