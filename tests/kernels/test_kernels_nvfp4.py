"""The fused C++ NVFP4 quantize against the PyTorch reference (``NVFP4Quantizer`` with
``FASTCAST_KERNELS=reference``), bit for bit: packed codes, E4M3 scale bytes and the
global scale, in every layout, block mode and input dtype, stochastic rounding included
(the fused path takes the reference's own draws)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import DTYPES, kernels_mode  # noqa: F401 - kernels_mode: a fixture

from fastcast.kernels import choice, fused_op
from fastcast.quantizers.nvfp4 import NVFP4Quantizer
from fastcast.reference import nvfp4 as nvfp4_reference
from fastcast.tensor import NVFP4Tensor

LAYOUTS = ((True, False), (False, True), (True, True))  # (rowwise, columnwise)
FIELDS = ("data", "scale_inv", "data_t", "scale_inv_t", "global_scale_inv")


@pytest.fixture(scope="module")
def op():
    choice.refresh()
    found = fused_op("quantize_nvfp4", torch.empty(1))
    if found is None:
        pytest.skip("the fused kernels are not available here")
    return found


@pytest.fixture
def spy(monkeypatch) -> list[int]:
    """Counts the reference's block encodings (none when the fused operator runs)."""
    calls: list[int] = []
    real = nvfp4_reference.encode_blocks
    monkeypatch.setattr(nvfp4_reference, "encode_blocks", lambda *a: calls.append(1) or real(*a))
    return calls


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t (any dtype, 0-dim included), to compare bit for bit."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def _quantize(mode: str, quantizer: NVFP4Quantizer, x: torch.Tensor, **kwargs) -> NVFP4Tensor:
    # The mode is read once per choice: set it, choose again (cheap: the library stays).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTCAST_KERNELS", mode)
        choice.refresh()
        try:
            return quantizer.quantize(x, **kwargs)
        finally:
            choice.refresh()


def _assert_same(fused: NVFP4Tensor, ref: NVFP4Tensor) -> None:
    for name in FIELDS:
        a, b = getattr(fused, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(_bytes(a), _bytes(b)), name
    assert (fused.shape, fused.dtype, fused.block, fused.block_t) == (
        ref.shape,
        ref.dtype,
        ref.block,
        ref.block_t,
    )


def _check(x: torch.Tensor, block_2d: bool, stochastic: bool = False, seed: int = 0) -> None:
    """Fused == reference in every layout the reference accepts for x."""
    quantizer = NVFP4Quantizer(block_2d=block_2d, stochastic_rounding=stochastic)
    for rowwise, columnwise in LAYOUTS:
        kwargs = {"rowwise": rowwise, "columnwise": columnwise}
        gen_ref, gen_fused = (torch.Generator().manual_seed(seed) for _ in range(2))
        try:
            ref = _quantize("reference", quantizer, x, generator=gen_ref, **kwargs)
        except ValueError:  # a shape the reference refuses: so must the fused path
            with pytest.raises(ValueError):
                _quantize("auto", quantizer, x, generator=gen_fused, **kwargs)
            continue
        fused = _quantize("auto", quantizer, x, generator=gen_fused, **kwargs)
        _assert_same(fused, ref)
        # The same draws, so the generators are left in the same state.
        assert torch.equal(gen_ref.get_state(), gen_fused.get_state())


SHAPES = [(16, 16), (32, 64), (3, 16, 32), (48, 160), (32,), (5, 48), (0, 16), (16, 0)]


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_on_shapes(op, shape, dtype, block_2d):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 3
    if x.dim() == 2 and x.shape[0]:  # rows of very different magnitudes
        x *= 10.0 ** torch.linspace(-4, 4, x.shape[0])[:, None]
    _check(x.to(dtype), block_2d)
    _check(x.to(dtype), block_2d, stochastic=True, seed=1)


def _special_blocks(dtype: torch.dtype) -> torch.Tensor:
    """32x64: blocks holding NaN, +-inf, zeros, -0.0, subnormal-scale and huge values."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    x[0, 3] = math.nan
    x[1, 20] = math.inf
    x[18, 40] = -math.inf
    x[2, 32:48] = 0.0
    x[3, 48:64] = -0.0
    x[4:20, 0:16] = 0.0
    x[5, 16:32] *= 1e-30  # block scales that round to E4M3 subnormals or 0
    x[6, 32:48] = -x[6, 32:48].abs() * 1e30  # the tensor amax (when finite)
    return x.to(dtype)


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_on_nonfinite_and_zero_blocks(op, dtype, block_2d):
    x = _special_blocks(dtype)
    _check(x, block_2d)  # a NaN amax: the tensor scale falls back to 1.0
    finite = x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    _check(finite, block_2d)
    _check(finite, block_2d, stochastic=True)
    _check(torch.full((16, 32), math.inf, dtype=dtype), block_2d)
    _check(torch.zeros(16, 32, dtype=dtype), block_2d)  # amax 0: scale 1.0
    _check(torch.full((16, 32), 1e-40).to(dtype), block_2d)  # a scale that would overflow


def _near_ties() -> torch.Tensor:
    """Elements that, scaled, land on the E2M1 midpoints and one FP32 step either side.

    One such value per block of row 0, every other element 6, and one 2688 (= 6 * 448) in
    the last block of row 15: s_enc is 1, so every block (row-wise, column-wise or tile)
    but that last one has amax 6, s_dec 1 and a multiplier of exactly 1.
    """
    midpoints = torch.tensor([m for m, _ in nvfp4_reference._MIDPOINTS])
    around = torch.cat(
        [midpoints, midpoints.nextafter(torch.tensor(0.0)), midpoints.nextafter(torch.tensor(9.0))]
    )
    values = torch.cat([around, -around, torch.tensor([6.0, -6.0, -0.0])])  # 45 values
    x = torch.full((16, 16 * 48), 6.0)
    x[0, : 16 * values.numel() : 16] = values
    x[15, -1] = 2688.0
    return x


@pytest.mark.parametrize("block_2d", [False, True])
def test_matches_reference_on_near_ties(op, block_2d):
    x = _near_ties()
    for dtype in DTYPES:
        _check(x.to(dtype), block_2d)
    q = _quantize("auto", NVFP4Quantizer(), x)
    assert q.global_scale_inv.item() == 1.0  # the construction holds


def test_scale_bytes_cover_the_e4m3_range(op):
    # Block amaxes from 1e-9 to 1 of the tensor's: every normal and subnormal E4M3 scale.
    x = torch.randn(64, 16 * 64, generator=torch.Generator().manual_seed(3)).abs() + 0.5
    x *= torch.logspace(-9, 0, 64 * 64).reshape(64, 64).repeat_interleave(16, dim=1)
    ref = _quantize("reference", NVFP4Quantizer(), x)
    assert len(set(_bytes(ref.scale_inv).tolist())) > 100
    _check(x, block_2d=False)


def test_stochastic_rounding_follows_the_global_generator(op):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    quantizer = NVFP4Quantizer(stochastic_rounding=True)
    for rowwise, columnwise in LAYOUTS:
        kwargs = {"rowwise": rowwise, "columnwise": columnwise}
        torch.manual_seed(5)
        ref = _quantize("reference", quantizer, x, **kwargs)
        ref_next = torch.rand(1)
        torch.manual_seed(5)
        fused = _quantize("auto", quantizer, x, **kwargs)
        _assert_same(fused, ref)
        assert torch.equal(torch.rand(1), ref_next)


def test_non_contiguous_input(op):
    x = torch.randn(64, 48)
    _check(x.t(), block_2d=False)
    _check(x.t(), block_2d=True)
    _check(torch.randn(4, 32, 16).permute(1, 0, 2), block_2d=False)


@settings(max_examples=40, deadline=None)
@given(
    strips=st.integers(1, 3),
    blocks=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    block_2d=st.booleans(),
    stochastic=st.booleans(),
    log_range=st.floats(-30, 30),
    special=st.sampled_from((None, 0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, 3e38)),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_property(
    op, strips, blocks, dtype, block_2d, stochastic, log_range, special, seed
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16 * strips, 16 * blocks, generator=gen) * 10.0**log_range
    if special is not None:
        x.view(-1)[seed % x.numel()] = special
    _check(x.to(dtype), block_2d, stochastic, seed)


def test_fake_impl_matches_shapes(op):
    op = choice.registered_op("quantize_nvfp4")
    x = torch.randn(32, 48)
    for block_2d in (False, True):
        for rowwise, columnwise in LAYOUTS:
            torch.library.opcheck(op, (x, block_2d, rowwise, columnwise, False, None, None))
    draws = torch.rand(32, 48)
    torch.library.opcheck(op, (x, False, True, True, True, draws, draws.t().contiguous()))
    torch.library.opcheck(op, (x.bfloat16(), True, True, True, True, draws, None))


def test_quantizer_uses_fused(op, kernels_mode, spy):  # noqa: F811 - the imported fixture
    kernels_mode("auto")
    x = torch.randn(2, 16, 32)
    NVFP4Quantizer().quantize(x, columnwise=True)
    NVFP4Quantizer(block_2d=True, stochastic_rounding=True).quantize(x, columnwise=True)
    assert spy == []  # the reference never ran


def test_reference_mode_forces_reference(kernels_mode, spy):  # noqa: F811
    kernels_mode("reference")
    NVFP4Quantizer().quantize(torch.randn(16, 32), columnwise=True)
    assert spy == [1, 1]
    assert fused_op("quantize_nvfp4", torch.empty(1)) is None


def test_operator_refuses_bad_arguments(op):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(torch.randn(4, 24), False, True, False, False, None, None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(torch.randn(4, 32), True, True, False, False, None, None)
    with pytest.raises(RuntimeError, match="needs rand"):
        op(torch.randn(16, 32), False, True, False, True, None, None)
    with pytest.raises(RuntimeError, match="rand_t must be FP32"):
        op(torch.randn(16, 32), False, False, True, True, None, torch.rand(3))


def _dequantized(mode: str, t: NVFP4Tensor) -> tuple[torch.Tensor, ...]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTCAST_KERNELS", mode)
        choice.refresh()
        try:
            out = [t.dequantize_rowwise_2d(), t.dequantize(torch.float32)]
            if t.has_columnwise:
                out.append(t.columnwise_operand().dequantize_rowwise_2d())
            return tuple(out)
        finally:
            choice.refresh()


@pytest.mark.parametrize(
    ("block_2d", "rht"), [(False, None), (True, None), (False, (1,) * 8 + (-1,) * 8)]
)
def test_fused_dequantize_equals_reference(op, block_2d, rht):
    """What the emulated NVFP4 GEMM reads (both layouts; the transformed column-wise
    one with its own tensor scale), fused == reference bit for bit, NaN blocks included."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(48, 64, generator=gen) * torch.logspace(-3, 3, 64)
    x[5, 17] = float("nan")
    x[32:48, 0:16] = 0.0  # an all-zero block (16x16 tile too)
    quantizer = NVFP4Quantizer(block_2d=block_2d, rht=rht)
    for dtype in (torch.float32, torch.bfloat16):
        t = quantizer.quantize(x.to(dtype), rowwise=True, columnwise=True)
        assert fused_op("dequantize_nvfp4", t.data) is not None
        for fused, ref in zip(_dequantized("auto", t), _dequantized("reference", t), strict=True):
            assert fused.dtype == ref.dtype == torch.float32 and fused.shape == ref.shape
            assert torch.equal(_bytes(fused), _bytes(ref))
        assert _dequantized("auto", t)[0].isnan().any()  # the NaN's block stays NaN


def test_fused_dequantize_refuses_bad_arguments(op):
    dequantize = fused_op("dequantize_nvfp4", torch.empty(1))
    packed = torch.zeros(16, 8, dtype=torch.uint8)
    scales = torch.ones(16, 1).to(torch.float8_e4m3fn)
    one = torch.ones(())
    assert dequantize(packed, scales, one, 1).shape == (16, 16)
    with pytest.raises(RuntimeError, match="1x16 or 16x16"):
        dequantize(packed, scales, one, 4)
    with pytest.raises(RuntimeError, match="scales for a 16x16 tensor"):
        dequantize(packed, scales, one, 16)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        dequantize(packed, scales.float(), one, 1)
    # (opcheck's schema test perturbs the inputs with ops FP8 lacks: the fake one only.)
    registered = choice.registered_op("dequantize_nvfp4")
    torch.library.opcheck(registered, (packed, scales, one, 1), test_utils="test_faketensor")
