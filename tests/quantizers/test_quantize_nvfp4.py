"""NVFP4Quantizer against an independent float64 reference.

The reference below shares no code with fastcast: it enumerates the E4M3 and E2M1 grids
from their bit layouts and rounds by searching the nearest grid value (ties to the even
code). Where NVFP4 prescribes an FP32 operation (the tensor scale, the block scale before
its E4M3 cast, the per-block multiplier, the scaled element) the reference computes it
in float64 and rounds the result to FP32, which for one operation on FP32 operands is
exactly the FP32 result; that is what makes bit-exact comparisons meaningful.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcast.quantizers.base import Quantizer
from fastcast.quantizers.nvfp4 import NVFP4Quantizer
from fastcast.tensor import NVFP4Tensor

F64 = torch.float64
FP32_MAX = torch.finfo(torch.float32).max
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)


def _e4m3_grid() -> torch.Tensor:
    """Non-negative finite E4M3 (fn) values, indexed by their byte (0x7F is NaN)."""
    values = []
    for byte in range(0x7F):
        exponent, mantissa = byte >> 3, byte & 7
        if exponent == 0:
            values.append(mantissa / 8 * 2.0**-6)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=F64)


E4M3_GRID = _e4m3_grid()


def f32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 values to FP32 (nearest even), keeping float64 storage."""
    return t.to(torch.float32).to(F64)


def nearest_even(values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the grid value nearest to each non-negative value; ties to the even index.

    Values above the grid saturate to its last entry.
    """
    flat = values.reshape(-1, 1).clamp(max=grid[-1].item())
    dist = (flat - grid).abs()
    tied = dist == dist.min(dim=1, keepdim=True).values
    preference = tied * (2 - torch.arange(len(grid)) % 2)  # even index first
    return preference.argmax(dim=1).reshape(values.shape)


@dataclasses.dataclass
class Reference:
    codes: torch.Tensor  # int64 [R, K], sign in bit 3
    scale_bytes: torch.Tensor  # int64 E4M3 bytes per tile
    dequant: torch.Tensor  # float64 [R, K]
    global_scale_inv: float


def reference(matrix: torch.Tensor, tile_rows: int) -> Reference:
    """NVFP4 of a 2D matrix with ``tile_rows x 16`` tiles (finite or infinite values)."""
    x = matrix.to(F64)
    rows, cols = x.shape
    # The tensor amax is that of the finite elements.
    finite_mag = x.abs().nan_to_num(nan=0.0, posinf=0.0)
    amax = finite_mag.max().item() if x.numel() else 0.0
    if amax == 0:
        s_enc = 1.0
    else:
        # The amax is floored (in FP32) so that the scale stays finite.
        amax = max(amax, f32(torch.tensor(6 * 448 / FP32_MAX, dtype=F64)).item())
        s_enc = f32(torch.tensor(6 * 448 / amax, dtype=F64)).item()
    tiles = x.reshape(rows // tile_rows, tile_rows, cols // 16, 16)
    tile_amax = tiles.abs().amax(dim=(1, 3))
    # E4M3 has no infinity: a tile holding one gets the NaN scale 0x7F, its elements the
    # codes +-0, and all of it dequantizes to NaN.
    finite = tile_amax.isfinite()
    # TransformerEngine's formulas, each step rounded to FP32: s_dec = amax_b * (s_enc *
    # (1/6)), the multiplier 1 / (s_dec * (1 / s_enc)).
    s_enc_6 = f32(torch.tensor(s_enc * f32(torch.tensor(1 / 6, dtype=F64)).item(), dtype=F64))
    scale_bytes = nearest_even(f32(tile_amax.nan_to_num(posinf=0.0) * s_enc_6), E4M3_GRID)
    scale_bytes = torch.where(finite, scale_bytes, 0x7F)
    s_dec = torch.where(finite, E4M3_GRID[scale_bytes.clamp(max=0x7E)], math.nan)
    safe = torch.where(s_dec == 0, 1.0, s_dec)
    s_dec_global = f32(torch.tensor(1 / s_enc, dtype=F64))
    encode = torch.where(s_dec == 0, 0.0, f32(1 / f32(safe * s_dec_global)).clamp(max=FP32_MAX))
    scaled = f32(tiles * encode[:, None, :, None])
    magnitude = nearest_even(scaled.abs(), E2M1_GRID)
    negative = tiles < 0
    codes = magnitude + 8 * negative
    gsi = f32(torch.tensor(1 / s_enc, dtype=F64)).item()
    values = torch.where(negative, -E2M1_GRID[magnitude], E2M1_GRID[magnitude])
    dequant = values * s_dec[:, None, :, None] * gsi
    return Reference(codes.reshape(rows, cols), scale_bytes, dequant.reshape(rows, cols), gsi)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, m/2]`` to int64 codes ``[n, m]``: low nibble first."""
    as_int = packed.to(torch.int64)
    out = torch.empty(*as_int.shape[:-1], as_int.shape[-1] * 2, dtype=torch.int64)
    out[..., 0::2] = as_int % 16
    out[..., 1::2] = as_int // 16
    return out


def e4m3_bytes(scales: torch.Tensor) -> torch.Tensor:
    assert scales.dtype == torch.float8_e4m3fn
    return scales.view(torch.uint8).to(torch.int64)


def assert_layout(
    data: torch.Tensor, scales: torch.Tensor, gsi: torch.Tensor, ref: Reference
) -> None:
    assert data.dtype == torch.uint8
    rows = ref.codes.shape[0]
    assert torch.equal(e4m3_bytes(scales), ref.scale_bytes)
    assert torch.equal(unpack_codes(data.reshape(rows, -1)), ref.codes)
    assert gsi.dtype == torch.float32 and gsi.dim() == 0
    assert gsi.item() == ref.global_scale_inv


def assert_dequant(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # FP32 decoding rounds twice (scale product, element product).
    torch.testing.assert_close(actual.to(F64), expected, rtol=2**-22, atol=2**-126)


def sample(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0):
    """Gaussian rows spanning three decades, so that block scales differ."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    rows = x.reshape(-1, shape[-1])
    rows *= 10.0 ** (torch.rand(rows.shape[0], 1, generator=gen) * 3 - 1.5)
    return x.to(dtype)


SHAPES = [(16, 64), (3, 5, 32), (32,), (48, 128), (2, 16, 48)]
LAYOUTS = [(shape, False) for shape in SHAPES] + [
    (shape, True) for shape in SHAPES if math.prod(shape[:-1]) % 16 == 0
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "block_2d"), LAYOUTS)
def test_rowwise_matches_reference(shape, block_2d, dtype):
    x = sample(shape, dtype)
    rows = math.prod(shape[:-1])
    q = NVFP4Quantizer(block_2d=block_2d).quantize(x)
    assert isinstance(q, NVFP4Tensor)
    assert q.fmt == "e2m1" and q.shape == x.shape and q.dtype == dtype
    assert q.data.shape == (*shape[:-1], shape[-1] // 2)
    assert q.block == ((16, 16) if block_2d else (1, 16))
    assert q.data_t is None and q.scale_inv_t is None
    ref = reference(x.reshape(rows, shape[-1]), 16 if block_2d else 1)
    assert q.scale_inv.shape == ref.scale_bytes.shape
    assert_layout(q.data, q.scale_inv, q.global_scale_inv, ref)
    out = q.dequantize()
    assert out.dtype == dtype and out.shape == x.shape
    assert_dequant(q.dequantize(torch.float32).reshape(rows, -1), ref.dequant)


def _codes_in_exact_order(matrix: torch.Tensor) -> torch.Tensor:
    """1x16 codes under the textbook order of operations, ``s_dec = amax_b / 6 * s_enc``
    and multiplier ``s_enc / s_dec`` (each step rounded to FP32): what TE's order is
    compared with."""
    x = matrix.to(F64)
    s_enc = f32(torch.tensor(6 * 448 / x.abs().max().item(), dtype=F64))
    blocks = x.reshape(x.shape[0], -1, 16)
    amax = blocks.abs().amax(dim=-1)
    s_dec = E4M3_GRID[nearest_even(f32(f32(amax / 6) * s_enc), E4M3_GRID)]
    scaled = f32(blocks * f32(s_enc / s_dec)[..., None])
    return (nearest_even(scaled.abs(), E2M1_GRID) + 8 * (blocks < 0)).reshape(x.shape)


def test_bf16_near_ties_match_transformer_engine():
    # bf16 values times FP32 multipliers land within an FP32 rounding of the E2M1
    # midpoints often enough that the order of the scale arithmetic decides a few codes
    # of 8192; the reference computes TE's order (s_dec = amax_b * (s_enc * (1/6)),
    # multiplier 1 / (s_dec * (1 / s_enc))).
    x = sample((64, 128), torch.bfloat16, seed=1)
    ref = reference(x.float(), 1)
    differ = (_codes_in_exact_order(x.float()) != ref.codes).sum().item()
    assert differ > 0  # the input does hit the near-ties where the two orders disagree
    for columnwise in (False, True):
        q = NVFP4Quantizer().quantize(x, columnwise=columnwise)
        assert_layout(q.data, q.scale_inv, q.global_scale_inv, ref)
    assert_layout(q.data_t, q.scale_inv_t, q.global_scale_inv, reference(x.float().t(), 1))


@pytest.mark.parametrize("shape", [(16, 64), (4, 8, 32), (64, 16)])
def test_columnwise_1x16_quantizes_the_transpose(shape):
    x = sample(shape, seed=1)
    q = NVFP4Quantizer().quantize(x, rowwise=True, columnwise=True)
    rows = math.prod(shape[:-1])
    cols = shape[-1]
    ref_t = reference(x.reshape(rows, cols).t(), 1)
    assert q.data_t.shape == (cols, rows // 2)
    assert q.scale_inv_t.shape == (cols, rows // 16)
    assert q.block_t == (1, 16)
    assert_layout(q.data_t, q.scale_inv_t, q.global_scale_inv, ref_t)
    # Row-wise data is unchanged by asking for the other layout too.
    assert_layout(q.data, q.scale_inv, q.global_scale_inv, reference(x.reshape(rows, cols), 1))
    only_t = NVFP4Quantizer().quantize(x, rowwise=False, columnwise=True)
    assert only_t.data is None and only_t.scale_inv is None
    assert torch.equal(only_t.data_t, q.data_t)
    assert torch.equal(only_t.scale_inv_t.view(torch.uint8), q.scale_inv_t.view(torch.uint8))
    assert_dequant(only_t.dequantize().reshape(rows, cols).t(), ref_t.dequant)
    if len(shape) == 2:
        assert_dequant(q.t().dequantize(), ref_t.dequant)


@pytest.mark.parametrize("stochastic", [False, True])
def test_columnwise_16x16_is_the_exact_transpose(stochastic):
    x = sample((32, 48), seed=2)
    quantizer = NVFP4Quantizer(block_2d=True, stochastic_rounding=stochastic)
    gen = torch.Generator().manual_seed(3)
    q = quantizer.quantize(x, columnwise=True, generator=gen)
    assert q.block_t == (16, 16) and q.data_t.shape == (48, 16)
    assert torch.equal(unpack_codes(q.data_t), unpack_codes(q.data).t())
    assert torch.equal(e4m3_bytes(q.scale_inv_t), e4m3_bytes(q.scale_inv).t())
    assert q.scale_inv_t.is_contiguous()
    assert torch.equal(q.t().dequantize(), q.dequantize().t())
    if not stochastic:
        ref = reference(x, 16)
        assert_layout(q.data, q.scale_inv, q.global_scale_inv, ref)
        only_t = quantizer.quantize(x, rowwise=False, columnwise=True)
        assert only_t.data is None
        assert torch.equal(only_t.data_t, q.data_t)


def test_non_contiguous_input():
    base = sample((64, 32), seed=4)
    x = base.t()
    assert not x.is_contiguous()
    q = NVFP4Quantizer().quantize(x, columnwise=True)
    assert_layout(q.data, q.scale_inv, q.global_scale_inv, reference(x, 1))
    assert_layout(q.data_t, q.scale_inv_t, q.global_scale_inv, reference(base, 1))


def _unit_block(values: list[float]) -> torch.Tensor:
    """A tensor whose amax is 6 in every block, so s_enc = 448, every s_dec = 448 and
    the elements are encoded unscaled (v = x)."""
    assert len(values) % 15 == 0
    blocks = [[6.0, *values[i : i + 15]] for i in range(0, len(values), 15)]
    return torch.tensor([sum(blocks, [])], dtype=torch.float32)


def _next(value: float, toward: float) -> float:
    return torch.nextafter(torch.tensor(value), torch.tensor(toward)).item()


def test_ties_round_to_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = _unit_block([*ties, *(-t for t in ties), 0.0])
    q = NVFP4Quantizer().quantize(x)
    assert q.global_scale_inv.item() == torch.tensor(1 / 448, dtype=torch.float32).item()
    assert e4m3_bytes(q.scale_inv).tolist() == [[0x7E]]  # 448
    expected_values = [6, 0, 1, 1, 2, 2, 4, 4, 0, -1, -1, -2, -2, -4, -4, 0]
    expected_codes = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
    assert unpack_codes(q.data).tolist() == [expected_codes]
    assert_dequant(q.dequantize()[0], torch.tensor(expected_values, dtype=F64))


def test_just_off_ties_round_to_nearest():
    up = [_next(t, 10.0) for t in (0.25, 1.25, 2.5, 5.0)]
    down = [_next(t, 0.0) for t in (0.75, 1.75, 3.5)]
    others = [0.1, 0.3, 5.9, 4.9, 1.1, 2.2, 2.8, 3.9]
    x = _unit_block([*up, *down, *others])
    codes = unpack_codes(NVFP4Quantizer().quantize(x).data).tolist()[0]
    # 0.5, 1.5, 3, 6 | 0.5, 1.5, 3 | 0, 0.5, 6, 4, 1, 2, 3, 4
    assert codes == [7, 1, 3, 5, 7, 1, 3, 5, 0, 1, 7, 6, 2, 4, 5, 6]


def test_block_scale_ties_round_to_even():
    # With s_enc = 448 (amax 6), these block amaxes give amax * (448 * (1/6)) exactly on
    # an E4M3 midpoint in FP32 (computed in this order, TE's): 76 -> 80, 39 -> 40, 68 -> 64.
    amaxes = [1.0178570747375488, 1.0178570747375488, 0.5223214030265808, 0.9107142686843872]
    x = torch.tensor([[6.0] * 16 + sum(([a] * 16 for a in amaxes), [])])
    raw = x[0, 16::16] * (torch.tensor(448.0) * torch.tensor(1.0).div(6.0))
    assert raw.tolist() == [76.0, 76.0, 39.0, 68.0]
    q = NVFP4Quantizer().quantize(x)
    # 448 = 0x7E; 80 = 1.25 * 2**6 -> (13 << 3) | 2; 40 -> (12 << 3) | 2; 64 -> 13 << 3
    assert e4m3_bytes(q.scale_inv).tolist() == [[0x7E, 106, 106, 98, 104]]
    assert_layout(q.data, q.scale_inv, q.global_scale_inv, reference(x, 1))


def test_elements_above_six_saturate():
    # Block 1 has amax 1: s_dec = 448/6 = 74.67 rounds down to 72 in E4M3, so the
    # elements scale to 448/72 = 6.22 > 6 and saturate to the code for 6.
    x = torch.tensor([[6.0] + [0.0] * 15 + [1.0] * 8 + [-1.0] * 8])
    q = NVFP4Quantizer().quantize(x)
    assert E4M3_GRID[e4m3_bytes(q.scale_inv)[0, 1]].item() == 72.0
    assert unpack_codes(q.data)[0, 16:].tolist() == [7] * 8 + [15] * 8
    expected = torch.tensor([6 * 72 / 448] * 8 + [-6 * 72 / 448] * 8, dtype=F64)
    assert_dequant(q.dequantize()[0, 16:], expected)
    assert_layout(q.data, q.scale_inv, q.global_scale_inv, reference(x, 1))


def test_infinity_poisons_its_block():
    x = torch.tensor([[float("inf"), 1.0] + [0.0] * 14 + [float("-inf")] + [2.0] * 15])
    q = NVFP4Quantizer().quantize(x)
    # The tensor amax is that of the finite elements, 2
    assert q.global_scale_inv.item() == torch.tensor(2 / 2688, dtype=torch.float32).item()
    # E4M3 has no infinity and E2M1 neither: each block's scale is NaN, not 448
    assert e4m3_bytes(q.scale_inv).tolist() == [[0x7F, 0x7F]]
    codes = unpack_codes(q.data)[0]
    assert codes[0].item() == 0 and codes[16].item() == 8  # +-0: the block scale decides
    assert q.dequantize()[0].isnan().all()
    assert_layout(q.data, q.scale_inv, q.global_scale_inv, reference(x, 1))


def test_nan_poisons_its_block_only():
    x = sample((16, 32), seed=5)
    zeroed = x.clone()
    zeroed[3, 5] = 0.0
    clean = NVFP4Quantizer().quantize(zeroed, columnwise=True)
    x[3, 5] = float("nan")
    q = NVFP4Quantizer().quantize(x, columnwise=True)
    # The NaN is left out of the tensor amax: every other block quantizes as it would
    # were the NaN a 0 (a NaN amax would reset the tensor scale to 1.0 and flush the
    # blocks of small values to zero).
    assert torch.equal(q.global_scale_inv, clean.global_scale_inv)
    others = torch.ones(16, 2, dtype=torch.bool)
    others[3, 0] = False
    assert torch.equal(e4m3_bytes(q.scale_inv)[others], e4m3_bytes(clean.scale_inv)[others])
    rows = torch.arange(16) != 3
    assert torch.equal(q.data[rows], clean.data[rows])
    assert torch.equal(q.data[3, 8:], clean.data[3, 8:])
    cols = torch.arange(32) != 5
    assert torch.equal(q.data_t[cols], clean.data_t[cols])
    # E4M3 NaN is S.1111.111, either sign
    assert e4m3_bytes(q.scale_inv)[3, 0].item() & 0x7F == 0x7F
    assert e4m3_bytes(q.scale_inv_t)[5, 0].item() & 0x7F == 0x7F
    assert (e4m3_bytes(q.scale_inv) & 0x7F == 0x7F).sum().item() == 1
    assert (e4m3_bytes(q.scale_inv_t) & 0x7F == 0x7F).sum().item() == 1
    assert unpack_codes(q.data)[3, 5].item() == 0
    out = q.dequantize()
    assert out[3, :16].isnan().all()
    nan_mask = torch.zeros_like(out, dtype=torch.bool)
    nan_mask[3, :16] = True
    assert not out[~nan_mask].isnan().any()
    out_t = q.t().dequantize()
    assert out_t[5, :].isnan().all() and not out_t[torch.arange(32) != 5].isnan().any()
    tiles = NVFP4Quantizer(block_2d=True).quantize(x).dequantize()
    assert tiles[:, :16].isnan().all() and not tiles[:, 16:].isnan().any()


@pytest.mark.parametrize("block_2d", [False, True])
def test_zeros(block_2d):
    x = torch.zeros(32, 32)
    q = NVFP4Quantizer(block_2d=block_2d).quantize(x, columnwise=True)
    assert q.global_scale_inv.item() == 1.0
    assert not e4m3_bytes(q.scale_inv).any() and not e4m3_bytes(q.scale_inv_t).any()
    assert not q.data.any() and not q.data_t.any()
    assert torch.equal(q.dequantize(), x)


def test_zero_and_negligible_blocks():
    # Block 1 is zero; block 2's s_dec = 1e-6 / 6 * 2.688 underflows E4M3 to 0.
    x = torch.tensor([[1000.0] * 16 + [0.0] * 16 + [1e-6] * 8 + [-1e-6] * 8])
    q = NVFP4Quantizer().quantize(x)
    assert e4m3_bytes(q.scale_inv)[0, 1:].tolist() == [0, 0]
    codes = unpack_codes(q.data)[0]
    assert codes[16:32].tolist() == [0] * 16
    assert codes[32:].tolist() == [0] * 8 + [8] * 8  # the sign of x is kept
    assert not q.dequantize()[0, 16:].any()
    assert_layout(q.data, q.scale_inv, q.global_scale_inv, reference(x, 1))


def test_tiny_amax_keeps_scales_finite():
    # 6 * 448 / 1e-37 overflows FP32: the amax is floored so that s_enc stays finite.
    x = torch.full((16, 32), 1e-37)
    x[0, 0] = -2e-37
    q = NVFP4Quantizer().quantize(x, columnwise=True)
    assert 0 < q.global_scale_inv.item() < float("inf")
    assert_layout(q.data, q.scale_inv, q.global_scale_inv, reference(x, 1))
    assert_layout(q.data_t, q.scale_inv_t, q.global_scale_inv, reference(x.t(), 1))
    assert torch.isfinite(q.dequantize()).all()


def test_round_trip_error_bound():
    # In the scaled domain rounding to E2M1 moves a value v by at most (|v| + 1) / 4
    # (1/4 around 0 and 1, then a quarter of the value: 5 -> 4, 0.75 -> 1, 6.3 -> 6).
    # The block unit s_dec * global_scale_inv maps that back to x.
    for block_2d in (False, True):
        x = sample((64, 256), seed=6)
        q = NVFP4Quantizer(block_2d=block_2d).quantize(x)
        out = q.dequantize().to(F64)
        tile = (16, 16) if block_2d else (1, 16)
        s_dec = E4M3_GRID[e4m3_bytes(q.scale_inv)]
        assert (s_dec >= 2**-6).all()  # normal E4M3 scales: at most 1/16 rounding
        unit = s_dec.repeat_interleave(tile[0], 0).repeat_interleave(16, 1)
        unit = unit * q.global_scale_inv.item()
        err = (out - x.to(F64)).abs()
        bound = 0.25 * (x.to(F64).abs() + unit) * (1 + 2**-20)
        assert (err <= bound).all()
        rel = (out - x.to(F64)).norm() / x.to(F64).norm()
        assert rel < 0.15


GRID_ROW = [6, 0, 0.5, 1, 1.5, 2, 3, 4, -0.5, -1, -1.5, -2, -3, -4, -6, 0]


def test_stochastic_rounding_keeps_grid_values():
    # Every row block and every column block holds a 6: both layouts encode unscaled.
    x = torch.tensor(
        [[GRID_ROW[(i + j) % 16] for j in range(32)] for i in range(32)], dtype=torch.float32
    )
    rne = NVFP4Quantizer().quantize(x)
    quantizer = NVFP4Quantizer(stochastic_rounding=True)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        q = quantizer.quantize(x, columnwise=True, generator=gen)
        assert torch.equal(q.data, rne.data)
        assert torch.equal(q.dequantize(), x)
        assert torch.equal(q.t().dequantize(), x.t())


def test_stochastic_rounding_saturates():
    x = torch.tensor([[6.0] + [0.0] * 15 + [1.0] * 8 + [-1.0] * 8] * 64)
    q = NVFP4Quantizer(stochastic_rounding=True).quantize(
        x, generator=torch.Generator().manual_seed(0)
    )
    assert unpack_codes(q.data)[:, 16:].unique().tolist() == [7, 15]


def test_stochastic_rounding_is_unbiased():
    between = [0.1, 0.7, 1.2, 1.9, 2.3, 3.6, 4.5, 5.5, -0.1, -1.2, -2.3, -4.5, -5.5, 0.3, 3.3]
    rows = 16384
    x = _unit_block(between).expand(rows, 16).contiguous()
    gen = torch.Generator().manual_seed(1234)
    q = NVFP4Quantizer(stochastic_rounding=True).quantize(x, generator=gen)
    out = q.dequantize().to(F64)
    target = x[0].to(F64)
    grid = torch.cat((-E2M1_GRID, E2M1_GRID))
    for col in range(1, 16):
        lower = grid[grid <= target[col]].max()
        upper = grid[grid >= target[col]].min()
        assert set(out[:, col].unique().tolist()) == {lower.item(), upper.item()}
    # One draw has a standard deviation of at most step / 2 <= 1, so the mean over
    # 16384 draws deviates by sigma <= 1/128; 0.06 is more than 7 sigma.
    assert (out[:, 1:].mean(dim=0) - target[1:]).abs().max() < 0.06
    # and it is not round-to-nearest: 2.3 must go up about 30% of the time
    up = (out[:, 5] == 3.0).double().mean().item()
    assert 0.25 < up < 0.35


def test_stochastic_rounding_follows_the_generator():
    x = sample((32, 64), seed=7)
    quantizer = NVFP4Quantizer(stochastic_rounding=True)

    def run(seed):
        return quantizer.quantize(x, generator=torch.Generator().manual_seed(seed)).data

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))
    # Scales do not depend on the rounding mode.
    rne = NVFP4Quantizer().quantize(x)
    sr = quantizer.quantize(x)
    assert torch.equal(e4m3_bytes(sr.scale_inv), e4m3_bytes(rne.scale_inv))


@pytest.mark.parametrize(
    ("shape", "kwargs", "match"),
    [
        ((16, 24), {}, r"last dimension \(K=24\) to be a multiple of 16"),
        ((4, 8), {}, r"K=8"),
        ((8, 32), {"columnwise": True}, r"R=8"),
        ((2, 4, 32), {"columnwise": True}, r"R=8"),
        ((8, 32), {"rowwise": False, "columnwise": True}, r"R=8"),
    ],
)
def test_bad_shapes(shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        NVFP4Quantizer().quantize(torch.ones(shape), **kwargs)


def test_bad_shapes_2d_tiles():
    with pytest.raises(ValueError, match=r"16x16 tiles.*R=8"):
        NVFP4Quantizer(block_2d=True).quantize(torch.ones(8, 32))
    with pytest.raises(ValueError, match=r"K=40"):
        NVFP4Quantizer(block_2d=True).quantize(torch.ones(16, 40))


def test_bad_inputs():
    with pytest.raises(TypeError, match="int32"):
        NVFP4Quantizer().quantize(torch.ones(16, 16, dtype=torch.int32))
    with pytest.raises(TypeError):
        NVFP4Quantizer().quantize([1.0] * 16)
    with pytest.raises(ValueError):
        NVFP4Quantizer().quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="rowwise"):
        NVFP4Quantizer().quantize(torch.ones(16, 16), rowwise=False)


def test_value_object():
    a, b = NVFP4Quantizer(block_2d=True), NVFP4Quantizer(block_2d=True)
    assert a == b and hash(a) == hash(b)
    assert a != NVFP4Quantizer() and a != NVFP4Quantizer(block_2d=True, stochastic_rounding=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.block_2d = False
    assert isinstance(a, Quantizer) and a.fmt == "e2m1"
    assert [f.name for f in dataclasses.fields(a)] == [
        "block_2d",
        "stochastic_rounding",
        "rht",
        "rht_round_to_input_dtype",
    ]
    with pytest.raises(ValueError, match="block_2d"):
        NVFP4Quantizer(block_2d=1)
    with pytest.raises(ValueError, match="signs must be 16 values"):
        NVFP4Quantizer(rht=(1, -1))
    with pytest.raises(ValueError, match="16x16 tiles"):
        NVFP4Quantizer(block_2d=True, rht=(1,) * 16)


def test_storage_sizes():
    x = sample((32, 64), seed=8)
    q = NVFP4Quantizer().quantize(x, columnwise=True)
    # two 32x64 layouts at 4 bits, 2 * 128 E4M3 scales, one FP32 global scale
    assert q.nbytes == 2 * 32 * 64 // 2 + 2 * 128 + 4
    assert q.global_scale_inv.shape == ()


def test_empty_rows():
    q = NVFP4Quantizer().quantize(torch.ones(0, 32))
    assert q.data.shape == (0, 16) and q.global_scale_inv.item() == 1.0
    assert q.dequantize().shape == (0, 32)


finite32 = st.floats(
    min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32
)


@settings(max_examples=40, deadline=None)
@given(
    row_tiles=st.integers(1, 2),
    col_blocks=st.integers(1, 3),
    block_2d=st.booleans(),
    exponent=st.integers(-100, 100),
    data=st.data(),
)
def test_property_matches_reference(row_tiles, col_blocks, block_2d, exponent, data):
    rows, cols = 16 * row_tiles, 16 * col_blocks
    values = data.draw(st.lists(finite32, min_size=rows * cols, max_size=rows * cols))
    x = torch.tensor(values, dtype=torch.float32).reshape(rows, cols)
    # Shift the whole tensor by a power of two (exact) to exercise the scale ranges.
    x = torch.ldexp(x, torch.tensor(exponent)).nan_to_num(posinf=FP32_MAX, neginf=-FP32_MAX)
    tile_rows = 16 if block_2d else 1
    q = NVFP4Quantizer(block_2d=block_2d).quantize(x, columnwise=True)
    ref = reference(x, tile_rows)
    assert_layout(q.data, q.scale_inv, q.global_scale_inv, ref)
    if block_2d:
        assert torch.equal(unpack_codes(q.data_t), ref.codes.t())
    else:
        assert_layout(q.data_t, q.scale_inv_t, q.global_scale_inv, reference(x.t(), 1))
    # Decoding is compared where FP32 keeps the block unit normal and the result finite.
    normal = E4M3_GRID[ref.scale_bytes] * ref.global_scale_inv >= 2**-126 * 8
    mask = normal.repeat_interleave(tile_rows, 0).repeat_interleave(16, 1)
    mask &= ref.dequant.abs() < FP32_MAX / 2
    out = q.dequantize().to(F64)
    assert_dequant(out[mask], ref.dequant[mask])
