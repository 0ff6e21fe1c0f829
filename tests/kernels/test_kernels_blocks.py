"""The fused C++ block-scaling and MXFP8 quantizes against the PyTorch reference, bit for
bit, and their choice (``FASTCAST_KERNELS``)."""

from __future__ import annotations

import math

import pytest
import test_kernels
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import DTYPES, FORMATS, SPECIALS, _bytes

from fastcast.formats import FP8_DTYPES
from fastcast.kernels import choice
from fastcast.quantizers import block, mx
from fastcast.quantizers.block import BlockScalingQuantizer
from fastcast.quantizers.mx import MXFP8Quantizer
from fastcast.reference import mx as mx_reference
from fastcast.reference import tiles

RULES = ("rceil", "ocp")

kernels_mode = test_kernels.kernels_mode  # the fixture that sets FASTCAST_KERNELS


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of t, whatever its strides (a same-size view needs none)."""
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def _fused(name: str):
    choice.refresh()
    found = choice.fused_op(name, torch.empty(1))
    if found is None:
        pytest.skip("the fused kernels are not available here")
    return found


@pytest.fixture(scope="module")
def block_op():
    return _fused("quantize_blocks")


@pytest.fixture(scope="module")
def mx_op():
    return _fused("quantize_mxfp8")


def _reference_blocks(m, tile_rows, fmt, power_2, epsilon):
    """quantize_tiles on its reference path (the fused operator hidden from it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block, "fused_op", lambda name, x: None)
        return block.quantize_tiles(m, tile_rows, fmt, power_2, epsilon)


def _reference_mx(m, fmt, rule):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mx, "fused_op", lambda name, x: None)
        return mx.quantize_blocks(m, fmt, rule)


def _check_blocks(op, m, tile_rows, fmt, power_2=True, epsilon=0.0):
    data, scale_inv = op(m, tile_rows, FP8_DTYPES[fmt], power_2, epsilon)
    ref_data, ref_scale_inv = _reference_blocks(m, tile_rows, fmt, power_2, epsilon)
    assert data.shape == m.shape and data.dtype == FP8_DTYPES[fmt] and data.is_contiguous()
    assert torch.equal(_bytes(data), _bytes(ref_data))
    assert scale_inv.shape == ref_scale_inv.shape and scale_inv.dtype == torch.float32
    assert torch.equal(scale_inv.view(torch.int32), ref_scale_inv.view(torch.int32))


def _check_mx(op, m, fmt, rule):
    data, e8m0 = op(m, FP8_DTYPES[fmt], rule == "ocp")
    ref_data, ref_e8m0 = _reference_mx(m, fmt, rule)
    assert data.shape == m.shape and data.dtype == FP8_DTYPES[fmt] and data.is_contiguous()
    assert torch.equal(_bytes(data), _bytes(ref_data))
    assert e8m0.dtype == torch.uint8 and torch.equal(e8m0, ref_e8m0)


def _matrix(shape, dtype, seed=0, log_range=(-20.0, 20.0), specials=True):
    """Random values over many magnitudes (each column its own), with the special values
    scattered in when asked."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    x = torch.randn(shape, generator=gen) * torch.logspace(*log_range, max(cols, 1))[:cols]
    if specials and x.numel():
        spots = torch.randint(0, x.numel(), (len(SPECIALS),), generator=gen)
        x.view(-1)[spots] = torch.tensor(SPECIALS)
    return x.to(dtype)


def _layouts(m):
    """m itself, and the same values as the transposed view of a row-major matrix (what
    the column-wise layouts pass)."""
    return (m, m.t().contiguous().t())


BLOCK_SHAPES = [(1, 1), (1, 300), (3, 128), (130, 257), (256, 256), (129, 1), (0, 5), (5, 0)]


@pytest.mark.parametrize("tile_rows", [1, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_blocks_match_reference(block_op, shape, dtype, tile_rows):
    for fmt in FORMATS:
        for m in _layouts(_matrix(shape, dtype)):
            _check_blocks(block_op, m, tile_rows, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tile_rows", [1, 128])
def test_blocks_scale_options_and_special_tiles(block_op, tile_rows, fmt):
    x = _matrix((130, 260), torch.float32, log_range=(-40.0, 38.0), specials=False)
    x[:, :128] = 0.0  # all-zero tiles: scale 1, or epsilon's
    x[:2, 128:256] = math.nan  # NaN in a tile: its scale falls back to 1
    x[128:, 256:] = -math.inf
    x[5, 200] = 1e-40  # a subnormal, in FP32 only
    for power_2, epsilon in ((False, 0.0), (True, 0.0), (False, 1e-3), (True, 1e-30)):
        _check_blocks(block_op, x, tile_rows, fmt, power_2, epsilon)
    _check_blocks(block_op, x[::2, 3:], tile_rows, fmt)  # neither layout: copied first


MX_SHAPES = [(1, 32), (3, 320), (130, 256), (64, 96), (0, 64), (5, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MX_SHAPES)
def test_mxfp8_matches_reference(mx_op, shape, dtype):
    for fmt in FORMATS:
        for rule in RULES:
            for m in _layouts(_matrix(shape, dtype, log_range=(-45.0, 38.0))):
                _check_mx(mx_op, m, fmt, rule)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_mxfp8_special_blocks(mx_op, fmt, rule):
    x = torch.randn(4, 256)
    x[0, :32] = 0.0  # amax 0: X = -127
    x[0, 32:64] = math.nan  # all NaN: amax 0 as well
    x[0, 64:96] = torch.tensor([math.inf, -math.inf] * 16)
    x[1, :32] = 1e-40  # a subnormal amax: X = -127, the subnormal 2**127 scale
    x[1, 32:64] = 3e38  # near the FP32 max: X clamps at the top
    x[2, :32] = float(torch.finfo(torch.float8_e4m3fn).max)  # rceil's mantissa boundary
    x[2, 32:64] = 448.0 * (1 + 2**-23)
    x[3, ::7] = math.nan
    for dtype in DTYPES:
        _check_mx(mx_op, x.to(dtype), fmt, rule)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 40),
    col_blocks=st.integers(0, 6),
    dtype=st.sampled_from(DTYPES),
    fmt=st.sampled_from(FORMATS),
    log_center=st.floats(-35, 35),
    special=st.sampled_from((None, *SPECIALS)),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_match_reference_property(
    block_op, mx_op, rows, col_blocks, dtype, fmt, log_center, special, transposed, seed
):
    cols = col_blocks * 32
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols + seed % 3, generator=gen) * 10.0**log_center
    if special is not None and x.numel():
        x.view(-1)[seed % x.numel()] = special
    m = x.to(dtype)
    if transposed:
        m = m.t().contiguous().t()
    _check_blocks(block_op, m, 1 + 127 * (seed % 2), fmt, bool(seed % 5), 0.0)
    _check_mx(mx_op, m[:, :cols], fmt, RULES[seed % 2])


def test_fake_impls_match_shapes(block_op, mx_op):
    x = torch.randn(130, 200)
    blocks = choice.registered_op("quantize_blocks")
    mx = choice.registered_op("quantize_mxfp8")
    torch.library.opcheck(blocks, (x, 1, torch.float8_e4m3fn, True, 0.0))
    torch.library.opcheck(blocks, (x, 128, torch.float8_e5m2, False, 1e-6))
    torch.library.opcheck(mx, (x[:, :192], torch.float8_e4m3fn, True))
    rows = choice.registered_op("quantize_rows")
    for columns in (False, True):
        torch.library.opcheck(rows, (x, torch.float8_e5m2, True, columns))


def test_bad_arguments_are_refused(block_op, mx_op):
    with pytest.raises(RuntimeError, match="tile_rows"):
        block_op(torch.randn(4, 4), 16, torch.float8_e4m3fn, True, 0.0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        mx_op(torch.randn(4, 40), torch.float8_e4m3fn, True)
    with pytest.raises(RuntimeError, match="FP8"):
        mx_op(torch.randn(4, 32), torch.float16, True)


def _spy(monkeypatch, module) -> list[int]:
    """Counts the reference's scale_and_cast calls in ``module``."""
    calls: list[int] = []
    real = module.scale_and_cast
    monkeypatch.setattr(module, "scale_and_cast", lambda *a: calls.append(1) or real(*a))
    return calls


QUANTIZERS = [  # the reference module each quantizer's fallback runs
    (tiles, BlockScalingQuantizer(block_dim=1)),
    (tiles, BlockScalingQuantizer(fmt="e5m2", block_dim=2, power_2_scales=False)),
    (mx_reference, MXFP8Quantizer()),
    (mx_reference, MXFP8Quantizer(fmt="e5m2", scale_rule="ocp")),
]


@pytest.mark.parametrize(("module", "quantizer"), QUANTIZERS)
def test_quantizers_use_fused_and_agree(block_op, kernels_mode, monkeypatch, module, quantizer):
    x = _matrix((96, 160), torch.bfloat16).reshape(3, 32, 160)  # 3-D: viewed as [96, 160]
    kernels_mode("reference")
    ref = quantizer.quantize(x, columnwise=True)
    kernels_mode("auto")
    calls = _spy(monkeypatch, module)
    fused = quantizer.quantize(x, columnwise=True)
    assert calls == []  # the reference never ran
    for name in ("data", "scale_inv", "data_t", "scale_inv_t"):
        a, b = getattr(fused, name), getattr(ref, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(_bits(a), _bits(b)), name


@pytest.mark.parametrize(("module", "quantizer"), QUANTIZERS)
def test_reference_mode_forces_reference(kernels_mode, monkeypatch, module, quantizer):
    kernels_mode("reference")
    calls = _spy(monkeypatch, module)
    quantizer.quantize(torch.randn(32, 128))
    assert calls
    assert choice.fused_op("quantize_blocks", torch.empty(1)) is None
    assert choice.fused_op("quantize_mxfp8", torch.empty(1)) is None
