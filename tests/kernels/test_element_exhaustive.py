"""The shared element arithmetic (``csrc/element.h``), as the CPU operators compile it for
the host, against the float64 definition (``tests/fp8_reference.py``): every BF16 bit
pattern and 2**20 FP32 values with the edge cases (ties between FP8 codes, subnormals,
the FP32 max, infinities, NaN), both formats, several scales. The CUDA kernels run the
same functions (``cuda/*.cu`` include the header), so this is their arithmetic's check
too; ``tests/cuda/test_native_cuda.py`` then compares the GPU with the CPU bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from fp8_reference import FMT_MAX, FP32_MAX, GRIDS, assert_codes_equal, encode_fp8

from fastcast.formats import FP8_DTYPES
from fastcast.kernels import choice

FORMATS = ("e4m3", "e5m2")
SCALES = (1.0, 0.37, 2.0**-20, 1e30)


@pytest.fixture(scope="module")
def ops():
    choice.refresh()
    x = torch.empty(1)
    found = {name: choice.fused_op(name, x) for name in ("quantize_tensorwise", "quantize_rows")}
    if any(op is None for op in found.values()):
        pytest.skip("the fused kernels are not available here")
    return found


def every_bf16() -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def fp32_cases() -> torch.Tensor:
    """2**20 FP32 values: wide-ranging normals and the edge cases of both formats."""
    g = torch.Generator().manual_seed(34)
    n = 1 << 20
    x = torch.randn(n, generator=g) * torch.exp2(torch.randn(n, generator=g) * 16)
    grid = torch.cat([GRIDS[f] for f in FORMATS])
    ties = ((grid[1:] + grid[:-1]) / 2).float()  # exact in FP32: ties to the even code
    edges = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1.17549435e-38, FP32_MAX, -FP32_MAX, 448.0, 464.0, 480.0]
        + [57344.0, 61440.0, 65536.0, math.inf, -math.inf, math.nan, -math.nan]
    )
    special = torch.cat([ties, -ties, edges, edges * 0.999, torch.nextafter(ties, ties * 2)])
    x[: special.numel()] = special
    return x


def reference_codes(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """FP8 codes of the FP32 product x * scale, finite values saturating (float64)."""
    product = (x.double() * scale).float().double()
    product = torch.where(x.isinf(), product, product.clamp(-FP32_MAX, FP32_MAX))
    return encode_fp8(product, fmt)


def reference_scales(amax: torch.Tensor, fmt: str, power_2: bool) -> torch.Tensor:
    """fp8_reference.reference_scale, elementwise, as FP32 values in float64."""
    a = amax.double()
    quotient = FMT_MAX[fmt] / a
    scale = torch.where(quotient >= FP32_MAX, FP32_MAX, quotient.float().double())
    if power_2:
        _, exponent = torch.frexp(scale)
        floor = 2.0**-149
        while FMT_MAX[fmt] / floor > FP32_MAX:
            floor *= 2.0
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1).clamp_min(floor)
    usable = a.isfinite() & (a > 0)
    return torch.where(usable, scale, 1.0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", SCALES)
def test_every_bf16_value_casts_as_the_definition(ops, fmt, scale):
    x = every_bf16()
    data, _, _ = ops["quantize_tensorwise"](
        x, torch.tensor([scale]), FP8_DTYPES[fmt], False, 0.0, True, False
    )
    assert_codes_equal(data, reference_codes(x, scale, fmt), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", SCALES)
def test_fp32_values_cast_as_the_definition(ops, fmt, scale):
    x = fp32_cases()
    data, _, _ = ops["quantize_tensorwise"](
        x, torch.tensor([scale]), FP8_DTYPES[fmt], False, 0.0, True, False
    )
    assert_codes_equal(data, reference_codes(x, scale, fmt), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("power_2", [False, True])
def test_scales_from_every_bf16_and_fp32_amax(ops, fmt, power_2):
    """scale_from_amax, once per one-element row (quantize_rows): every BF16 magnitude and
    2**20 FP32 ones as amaxes, 0, subnormals, inf and NaN among them."""
    for x in (every_bf16(), fp32_cases()):
        column = x.reshape(-1, 1)
        _, scale_inv = ops["quantize_rows"](column, FP8_DTYPES[fmt], power_2, False)
        want = 1.0 / reference_scales(column.abs().reshape(-1), fmt, power_2)
        got = scale_inv.reshape(-1)
        assert torch.equal(got.view(torch.int32), want.float().view(torch.int32))
