"""The fused C++ per-tensor quantize against the PyTorch reference, bit for bit, and the
choice between them (``FASTCAST_KERNELS``, a failed build)."""

from __future__ import annotations

import itertools
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fastcast as fc
from fastcast import kernels
from fastcast.formats import ELEMENT_MAX, FP8_DTYPES
from fastcast.kernels import build, choice
from fastcast.quantizers import tensorwise
from fastcast.quantizers.tensorwise import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    quantize_with_scale,
)
from fastcast.reference.cast import as_matrix, scale_and_cast, scale_from_amax, tensor_amax
from fastcast.schemes.delayed import ScalingMeta, ScalingOrigin, Slab
from fastcast.schemes.delayed import state as delayed_state

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORMATS = ("e4m3", "e5m2")


@pytest.fixture(scope="module")
def op():
    choice.refresh()
    found = choice.tensorwise_op(torch.empty(1))
    if found is None:
        pytest.skip("the fused kernels are not available here")
    return found


@pytest.fixture
def kernels_mode(monkeypatch):
    """Set FASTCAST_KERNELS for one test; the choice is made again after it."""

    def set_mode(mode: str) -> None:
        monkeypatch.setenv("FASTCAST_KERNELS", mode)
        choice.refresh()

    yield set_mode
    monkeypatch.delenv("FASTCAST_KERNELS", raising=False)
    choice.refresh()


def _reference(x, fmt, scale=None, power_2=False, epsilon=0.0):
    if scale is None:
        amax = tensor_amax(x)
        scale = scale_from_amax(amax, ELEMENT_MAX[fmt], power_2=power_2, epsilon=epsilon)
    return scale_and_cast(x, scale, fmt), scale.reciprocal()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _check(op, x, fmt, scale=None, power_2=False, epsilon=0.0):
    data, scale_inv, data_t = op(x, scale, FP8_DTYPES[fmt], power_2, epsilon, True, True)
    ref_data, ref_scale_inv = _reference(x, fmt, scale, power_2, epsilon)
    assert data.shape == x.shape and data.dtype == FP8_DTYPES[fmt]
    _assert_same_codes(data, ref_data, x.dtype)
    _assert_same_codes(data_t, as_matrix(ref_data).t(), x.dtype)
    assert scale_inv.shape == ref_scale_inv.shape
    assert torch.equal(scale_inv.view(torch.int32), ref_scale_inv.view(torch.int32))


def _assert_same_codes(got, want, input_dtype):
    """FP8 codes equal byte for byte. One exception: the sign of a NaN code from a 16-bit
    input, which the reference leaves to ATen's widening (its scalar path, taken for
    tiny tensors, makes a half or bfloat16 NaN positive; its vectorised path keeps the
    sign). There the NaNs must still sit in the same places."""
    got_bytes, want_bytes = _bytes(got), _bytes(want)
    if input_dtype != torch.float32:
        nan = want.float().isnan()
        assert torch.equal(got.float().isnan(), nan)
        got_bytes, want_bytes = got_bytes[~nan], want_bytes[~nan]
    assert torch.equal(got_bytes, want_bytes)


SPECIALS = (0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-45, -1e-40, 3e38, -3e38)


def _specials(dtype, n=300):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=gen) * torch.logspace(-20, 20, n)
    x[: len(SPECIALS)] = torch.tensor(SPECIALS)
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1,), (7,), (33, 17), (3, 5, 129), (128, 256), (0,), (0, 5), (5, 0)]
)
def test_matches_reference_on_shapes(op, shape, dtype, fmt):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    _check(op, x, fmt)
    _check(op, x, fmt, scale=torch.tensor([7.5]))  # a given (delayed) scale


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_on_nonfinite_and_extreme_values(op, dtype, fmt):
    x = _specials(dtype)
    _check(op, x, fmt)  # NaN amax: the scale falls back to 1.0
    _check(op, x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), fmt)  # huge and tiny
    _check(op, x, fmt, scale=torch.tensor(1e30))  # finite products overflow FP32
    _check(op, torch.full((4, 4), math.inf, dtype=dtype), fmt)
    _check(op, torch.zeros(9, 3, dtype=dtype), fmt)  # amax 0: scale 1.0
    _check(op, torch.full((4,), 1e-40).to(dtype), fmt)  # a scale that would overflow


@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_reference_with_scale_options(op, fmt):
    x = _specials(torch.float32).nan_to_num(nan=1.0, posinf=2.0, neginf=-2.0) * 1e-10
    for power_2, epsilon in ((True, 0.0), (False, 1e-3), (True, 1e-12)):
        _check(op, x, fmt, power_2=power_2, epsilon=epsilon)
    _check(op, torch.zeros(3), fmt, epsilon=0.5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_input(op, fmt):
    x = torch.randn(40, 24)
    _check(op, x.t(), fmt)
    _check(op, x[::3, 1::2], fmt)
    _check(op, torch.randn(4, 6, 10).permute(2, 0, 1), fmt)


def test_rounding_matches_torch_cast_over_many_bit_patterns(op):
    # Every 9973rd FP32 bit pattern, clamped into each format's range: the kernel's own
    # FP8 rounding against torch's .to(float8).
    bits = torch.arange(0, 2**32, 9973, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    values = values[torch.isfinite(values)]
    for fmt in FORMATS:
        y = values.clamp(-ELEMENT_MAX[fmt], ELEMENT_MAX[fmt])
        data, _, _ = op(y, torch.ones(()), FP8_DTYPES[fmt], False, 0.0, True, False)
        assert torch.equal(_bytes(data), _bytes(y.to(FP8_DTYPES[fmt])))


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    fmt=st.sampled_from(FORMATS),
    log_range=st.floats(-30, 30),
    special=st.sampled_from((None, *SPECIALS)),
    seed=st.integers(0, 2**16),
)
# Found by this test: a one-element half tensor holding -NaN (see _assert_same_codes).
@example(shape=[1], dtype=torch.float16, fmt="e5m2", log_range=0.0, special=-math.nan, seed=0)
def test_matches_reference_property(op, shape, dtype, fmt, log_range, special, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 10.0**log_range
    if special is not None and x.numel():
        x.view(-1)[seed % x.numel()] = special
    _check(op, x.to(dtype), fmt)


def test_fake_impl_matches_shapes(op):
    x = torch.randn(6, 10)
    registered = choice.registered_op("quantize_tensorwise")
    torch.library.opcheck(registered, (x, None, torch.float8_e4m3fn, False, 0.0, True, True))
    args = (x, torch.ones(1), torch.float8_e5m2, False, 0.0, True, False)
    torch.library.opcheck(registered, args)


def _spy_reference(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = tensorwise.scale_and_cast
    monkeypatch.setattr(tensorwise, "scale_and_cast", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("columnwise", [False, True])
def test_quantizer_uses_fused_and_agrees(op, kernels_mode, monkeypatch, columnwise):
    x = torch.randn(3, 16, 32)
    quantizer = CurrentScalingQuantizer(fmt="e5m2")
    kernels_mode("reference")
    ref = quantizer.quantize(x, columnwise=columnwise)
    ref_scaled = quantize_with_scale(x, torch.tensor([2.0]), "e4m3", True, columnwise)
    kernels_mode("auto")
    calls = _spy_reference(monkeypatch)
    fused = quantizer.quantize(x, columnwise=columnwise)
    fused_scaled = quantize_with_scale(x, torch.tensor([2.0]), "e4m3", True, columnwise)
    assert calls == []  # the reference never ran
    for a, b in ((fused, ref), (fused_scaled, ref_scaled)):
        assert torch.equal(_bytes(a.data), _bytes(b.data))
        assert torch.equal(a.scale_inv, b.scale_inv) and a.scale_inv.shape == b.scale_inv.shape
        if columnwise:
            assert torch.equal(_bytes(a.data_t), _bytes(b.data_t))
            assert a.data_t.shape == b.data_t.shape
        assert torch.equal(a.dequantize(), b.dequantize())


def test_reference_mode_forces_reference(kernels_mode, monkeypatch):
    kernels_mode("reference")
    calls = _spy_reference(monkeypatch)
    CurrentScalingQuantizer().quantize(torch.randn(4, 4))
    assert calls == [1]
    assert kernels.tensorwise_op(torch.empty(1)) is None


def test_unsupported_inputs_fall_back(op, kernels_mode, monkeypatch):
    kernels_mode("auto")
    calls = _spy_reference(monkeypatch)
    x = torch.randn(4, 4)
    assert kernels.tensorwise_op(x.to("meta")) is None  # not a CPU tensor
    quantize_with_scale(x, torch.tensor(2.0, dtype=torch.float64), "e4m3", True, False)
    assert calls == [1]  # a scale the kernel does not take


def test_invalid_mode_is_refused(kernels_mode):
    kernels_mode("fast")
    with pytest.raises(ValueError, match="FASTCAST_KERNELS"):
        kernels.tensorwise_op(torch.empty(1))


def _break_the_compiler(monkeypatch, tmp_path):
    # A fresh build directory (nothing cached, no installed library) and a compiler that
    # does not exist; the process forgets its loaded library for the test (restored after).
    monkeypatch.setattr(build, "_loaded_seconds", None)
    monkeypatch.setenv("FASTCAST_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("FASTCAST_KERNELS_INSTALLED", "0")  # not an install's library
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))


def test_failed_build_warns_once_and_falls_back(kernels_mode, monkeypatch, tmp_path):
    _break_the_compiler(monkeypatch, tmp_path)
    kernels_mode("auto")
    calls = _spy_reference(monkeypatch)
    with pytest.warns(RuntimeWarning, match="could not be built") as record:
        CurrentScalingQuantizer().quantize(torch.randn(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        CurrentScalingQuantizer().quantize(torch.randn(4, 4))
    assert len(record) == 1 and calls == [1, 1]


def test_failed_build_is_an_error_when_fused_is_forced(kernels_mode, monkeypatch, tmp_path):
    _break_the_compiler(monkeypatch, tmp_path)
    kernels_mode("fused")
    with pytest.raises(RuntimeError, match="FASTCAST_KERNELS=fused"):
        CurrentScalingQuantizer().quantize(torch.randn(4, 4))


def test_build_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTCAST_KERNELS_DIR", str(tmp_path))
    assert build.build_dir().parent == tmp_path


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_gemm_equals_scaled_mm(op, out_dtype, with_bias):
    """The fused per-tensor GEMM gives torch._scaled_mm's CPU values bit for bit, for
    both FP8 formats, transposed (strided) operands and a bias of the output dtype."""
    gemm = choice.fused_op("scaled_mm_tensorwise", torch.empty(1))
    gen = torch.Generator().manual_seed(3)
    for (m, k, n), fmts in itertools.product(
        [(16, 16, 16), (33, 64, 17), (1, 8, 5)], [("e4m3", "e4m3"), ("e4m3", "e5m2")]
    ):
        a = (torch.randn(m, k, generator=gen) * 4).to(FP8_DTYPES[fmts[0]])
        b = (torch.randn(k, n, generator=gen) * 4).to(FP8_DTYPES[fmts[1]]).t()  # strided
        scale_a, scale_b = torch.tensor(0.37), torch.tensor(1.9)
        bias = torch.randn(n, generator=gen).to(out_dtype) if with_bias else None
        want = torch._scaled_mm(
            a, b.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype
        )
        got = gemm(a, b, scale_a, scale_b, bias, out_dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_scaled_mm_takes_the_fused_gemm_with_the_same_values(op, kernels_mode):
    """fc.scaled_mm on per-tensor CPU operands (3-D input, a bias, bf16 output) gives
    the same bits with the fused kernels as with torch._scaled_mm."""
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(5))
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(16).bfloat16()

    def product():
        a = tensorwise.CurrentScalingQuantizer().quantize(x)
        b = tensorwise.CurrentScalingQuantizer().quantize(w)
        return fc.scaled_mm(a, b, out_dtype=torch.bfloat16, bias=bias)

    kernels_mode("reference")
    want = product()
    kernels_mode("auto")
    assert choice.fused_op("scaled_mm_tensorwise", x) is not None
    assert torch.equal(product(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_record_amax_equals_reference(op, kernels_mode, dtype):
    """The delayed-scaling amax slot (a view into a slab) ends with the same value fused
    and reference: the larger of slot and amax, a non-finite amax recording nothing."""
    gen = torch.Generator().manual_seed(4)
    inputs = [
        torch.randn(8, 24, generator=gen) * 3,
        torch.randn(5, generator=gen) * 1e-3,  # below the slot: it keeps its value
        torch.tensor([1.0, float("inf"), -2.0]),
        torch.tensor([float("nan"), 7.0]),
        torch.randn(2, 3, 16, generator=gen)[:, :, ::2] * 50,  # 3-D, not contiguous
        torch.empty(0, 4),
    ]

    def slots_after() -> torch.Tensor:
        slab = torch.zeros(3)
        for i, x in enumerate(inputs):
            tensorwise.record_amax(slab[i % 3 : i % 3 + 1], x.to(dtype))
        return slab

    kernels_mode("reference")
    want = slots_after()
    kernels_mode("auto")
    assert choice.fused_op("record_amax", torch.empty(1)) is not None
    assert torch.equal(slots_after(), want)
    # Slot 2 saw only the inf's tensor and the empty one: nothing was recorded.
    assert want[:2].gt(0).all() and want[2] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_delayed_quantize_is_one_pass_with_the_reference_values(
    op, kernels_mode, monkeypatch, dtype, fmt
):
    """Delayed scaling's quantize (scale known, amax recorded) runs one fused operator,
    never the separate amax pass, with the reference's codes, scale_inv and slot."""
    gen = torch.Generator().manual_seed(9)
    inputs = [
        torch.randn(8, 24, generator=gen) * 3,
        torch.randn(40_000, generator=gen) * 1e-2,  # several parallel chunks
        torch.tensor([1.0, float("inf"), -2.0, float("nan")]),  # non-finite: no record
        torch.randn(2, 3, 16, generator=gen)[:, :, ::2] * 900,  # 3-D, not contiguous
        torch.empty(0, 4),
    ]

    def run() -> tuple[list, torch.Tensor]:
        meta = SimpleNamespace(
            scale_views=list(torch.tensor([0.5, 2.0, 1e-3]).split(1)),
            amax_slots=list(torch.zeros(3).split(1)),
        )
        quantizers = [DelayedScalingQuantizer(meta, i, fmt) for i in range(3)]
        outs = [
            quantizers[i % 3].quantize(x.to(dtype), columnwise=True) for i, x in enumerate(inputs)
        ]
        return outs, torch.cat(meta.amax_slots)

    kernels_mode("reference")
    want, want_slots = run()
    kernels_mode("auto")
    monkeypatch.setattr(tensorwise, "record_amax", lambda *a: pytest.fail("a separate amax pass"))
    got, got_slots = run()
    assert torch.equal(got_slots, want_slots)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bytes(a.data), _bytes(b.data))
        assert torch.equal(a.scale_inv, b.scale_inv) and a.scale_inv.shape == b.scale_inv.shape
        assert torch.equal(_bytes(a.data_t), _bytes(b.data_t))


def test_fused_dequantize_equals_reference(op, kernels_mode):
    """Dequantized layouts (what the emulated GEMMs read) are bit for bit the reference's
    for per-tensor, 1x128, 128x128 and MXFP8 tensors, partial tiles, both layouts and
    non-finite codes included."""
    from fastcast.quantizers.block import BlockScalingQuantizer
    from fastcast.quantizers.mx import MXFP8Quantizer
    from fastcast.quantizers.rowwise import RowwiseQuantizer

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(200, 320, generator=gen) * 5
    x[3, 7], x[150, 300], x[9, 9] = float("inf"), float("nan"), float("-inf")
    cases = [
        (CurrentScalingQuantizer(fmt="e5m2"), x),
        (BlockScalingQuantizer(), x),
        (BlockScalingQuantizer(block_dim=2, fmt="e5m2"), x[:, :300]),
        (MXFP8Quantizer(), x[:192]),
        (RowwiseQuantizer(fmt="e5m2", power_2_scales=False), x),  # column-wise: a .t() view
    ]

    def layouts() -> list[torch.Tensor]:
        out = []
        for quantizer, t in cases:
            q = quantizer.quantize(t, rowwise=True, columnwise=True)
            out += [q.dequantize_rowwise_2d(), q.columnwise_operand().dequantize_rowwise_2d()]
        return out

    kernels_mode("reference")
    want = layouts()
    kernels_mode("auto")
    assert choice.fused_op("dequantize_blocks", x) is not None
    for got, expected in zip(layouts(), want):
        assert got.shape == expected.shape
        assert torch.equal(got.view(torch.int32), expected.contiguous().view(torch.int32))


@pytest.mark.parametrize("block", [(0, 0), (1, 0), (1, 128), (128, 128), (1, 32), (5, 7)])
def test_fused_dequantize_reads_a_transposed_view_as_its_copy(op, block):
    """A column-wise layout taken as the .t() view is read in place; the values are
    those of its contiguous copy (partial tiles, non-finite codes included)."""
    dequantize = choice.fused_op("dequantize_blocks", torch.empty(1))
    gen = torch.Generator().manual_seed(2)
    stored = torch.randint(0, 256, (300, 130), dtype=torch.uint8, generator=gen)
    view = stored.view(torch.float8_e4m3fn).t()  # [130, 300], stride (1, 130)
    rows, cols = view.shape
    grid = [1 if b == 0 else -(-n // b) for b, n in zip(block, (rows, cols), strict=True)]
    scales = torch.rand(grid, generator=gen) * 4
    got = dequantize(view, scales, *block)
    want = dequantize(view.contiguous(), scales, *block)
    assert got.is_contiguous() and torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_fused_dequantize_decodes_every_e8m0_byte(op):
    """MXFP8 scales reach the fused dequantization as E8M0 bytes: every byte, 2**-127
    (subnormal) and 255 (NaN) included, decodes as the reference's decode_e8m0."""
    from fastcast.reference.decode import decode_e8m0

    dequantize = choice.fused_op("dequantize_blocks", torch.empty(1))
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1)
    data = torch.full((256, 32), 1.5).to(torch.float8_e4m3fn)
    want = data.float() * decode_e8m0(scales)
    got = dequantize(data, scales, 1, 32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_entry_points_dispatch_like_the_registered_operators(op):
    """fused_op hands out direct entry points (bindings.cpp); they must reach the same
    operator through the dispatcher, so modes and fake tensors see what torch.ops shows."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(6, 10)
    args = (x, None, torch.float8_e5m2, True, 0.0, True, False)
    with Seen() as seen:
        direct = op(*args)
    assert seen.ops == ["fastcast_kernels.quantize_tensorwise.default"]
    registered = choice.registered_op("quantize_tensorwise")(*args)
    for a, b in zip(direct, registered, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bytes(a.reshape(-1)), _bytes(b.reshape(-1)))

    with FakeTensorMode() as mode:
        fake = op(mode.from_tensor(x), None, torch.float8_e4m3fn, False, 0.0, True, False)
    assert [tuple(t.shape) for t in fake] == [(6, 10), (), (0,)]
    assert fake[0].dtype == torch.float8_e4m3fn and type(fake[0]).__name__ == "FakeTensor"


@settings(max_examples=60, deadline=None)
@given(
    # Windows and widths on both sides of the operator's 64-element stride, the default
    # window (1024) among them.
    rows=st.sampled_from([1, 2, 5, 67, 1024]),
    cols=st.integers(1, 70),
    every_column_ran=st.booleans(),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    margin=st.sampled_from([0, 1, 3]),
    algo=st.sampled_from(["max", "most_recent"]),
    seed=st.integers(0, 2**16),
)
@example(rows=3, cols=2, every_column_ran=False, fmt="e4m3", margin=0, algo="max", seed=0)
def test_fused_delayed_update_equals_reference(
    op, rows, cols, every_column_ran, fmt, margin, algo, seed
):
    """A slab's update (new scales, rolled history, row 0 zeroed) is one fused operator
    on the CPU with the reference's values bit for bit: columns that recorded nothing,
    amaxes of zero, tiny, huge and non-finite windows, every margin and window rule."""
    gen = torch.Generator().manual_seed(seed)
    history = torch.rand(rows, cols, generator=gen) * torch.pow(
        10.0, torch.randint(-44, 39, (rows, cols), generator=gen).float()
    )
    history[torch.rand(rows, cols, generator=gen) < 0.3] = 0.0
    if every_column_ran:
        history[0] = torch.rand(cols, generator=gen) + 0.5
    if seed % 5 == 0:
        history[-1, 0] = float("inf") if seed % 2 else float("nan")
    scale = torch.rand(cols, generator=gen) * 100 + 1e-3
    recipe = fc.DelayedScaling(amax_history_len=rows, margin=margin, amax_compute_algo=algo)

    def update(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        slab = Slab(recipe, None, fmt, torch.device("cpu"))
        meta = ScalingMeta.holding(history.clone(), scale.clone(), ScalingOrigin.of(recipe, fmt))
        slab._rebuild([meta])
        if fused:
            slab.update()
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(delayed_state, "fused_op", lambda name, x: None)
                slab.update()
        return slab.history.view(torch.int32), slab.scale.view(torch.int32)

    got, want = update(True), update(False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Independently, in float64: a column with a finite amax > 0 recorded this step
    # takes fmt_max / amax / 2**margin (rounded once to FP32, clamped to the FP32 range).
    window = history if algo == "max" else history[:1]
    for j in range(cols):
        amax = window[:, j].double().max().item()
        if history[0, j] > 0 and math.isfinite(amax):
            expect = min(ELEMENT_MAX[fmt] / amax / 2.0**margin, torch.finfo().max)
            assert got[1][j].view(torch.float32).item() == pytest.approx(expect, rel=2**-23)
        elif history[0, j] <= 0 or math.isnan(history[0, j]):
            assert got[1][j] == scale[j : j + 1].view(torch.int32)
    # The window: a column that recorded moves up one row, its amax entering last;
    # the others keep theirs; row 0 restarts at zero.
    new = got[0].view(torch.float32)
    ran = history[0] > 0
    assert torch.equal(new[0], torch.zeros(cols))
    if rows > 1:
        moved = torch.cat([history[2:], history[:1]])
        expect = torch.where(ran, moved, history[1:])
        assert torch.equal(new[1:].view(torch.int32), expect.view(torch.int32))


def test_delayed_update_operator_schema_and_fake(op):
    """The update operator declares the tensors it writes (history and scale), so that
    fake tensors, functionalization and AOT dispatch treat it right (torch's opcheck)."""
    history = torch.tensor([[3.0, 0.0, 1.0], [2.0, 5.0, 0.5]])
    scale = torch.tensor([1.0, 2.0, 4.0])
    args = (history, scale, 448.0, 448.0 / torch.finfo().max, 0.0, False)
    results = torch.library.opcheck(choice.registered_op("delayed_update"), args)
    assert set(results.values()) == {"SUCCESS"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_e5m2_nan_codes_keep_the_input_sign(dtype):
    """Every 16-bit NaN pattern, both signs, quiet and signalling: E5M2's NaN code carries
    the input's sign. The rule the CUDA kernels are held to (an H200 run found the
    device's FP16 widening made every NaN positive, so the codes differed)."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = patterns.view(dtype).reshape(256, 256)
    op = build.entry_points()["quantize_tensorwise"]
    for scale in (None, torch.full((), 0.37)):
        data, _, _ = op(x, scale, torch.float8_e5m2, False, 0.0, True, False)
        codes = data.reshape(-1).view(torch.uint8).to(torch.int32)
        nan = x.reshape(-1).float().isnan()
        assert torch.equal((codes & 0x7F)[nan], torch.full_like(codes[nan], 0x7F))
        negative = patterns.to(torch.int32) < 0
        assert torch.equal((codes[nan] >> 7).bool(), negative[nan])
