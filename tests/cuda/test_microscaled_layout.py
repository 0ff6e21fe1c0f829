"""MXFP8 / NVFP4 operands as sm100's block-scaled GEMM reads them, checked on the CPU.

``swizzle_32_4_4`` against the cuBLAS "1D block scaling factors layout" written out as
index arithmetic (independent of the reshape/permute it is implemented with); the full
``F.scaled_mm`` arguments against torch's own meta checks; and a product computed from
those arguments alone (un-swizzling the scales, decoding the codes, in float64) against
the emulated GEMM, so a misplaced scale or nibble cannot pass.
"""

from __future__ import annotations

import pytest
import torch

import fastcast as fc
from fastcast.gemm_microscaled import microscaled_args, padded_scale_shape, swizzle_32_4_4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def swizzled_offset(r: int, c: int, cols: int) -> int:
    """cuBLAS's offset of scale (row r, K-block c), ``cols`` K-blocks a row: 128x4 tiles
    in row-major tile order, 512 bytes each; inside one, row r % 32 is a 16-byte line
    holding the four 32-row groups' four K-blocks."""
    tiles_per_row = -(-cols // 4)
    tile = (r // 128) * tiles_per_row + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle_reference(scales: torch.Tensor) -> torch.Tensor:
    """The layout by the formula: float64 values of the bytes, zeros where padded."""
    rows, cols = scales.shape
    pr, pc = padded_scale_shape(rows, cols)
    out = torch.zeros(pr * pc, dtype=torch.float64)
    values = scales.view(torch.uint8).double()
    for r in range(rows):
        for c in range(cols):
            out[swizzled_offset(r, c, cols)] = values[r, c]
    return out


def unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Row-major ``[rows, cols]`` bytes read back from the swizzled layout (the gather
    a kernel does), by the same formula."""
    raw = flat.view(torch.uint8)
    index = torch.tensor(
        [[swizzled_offset(r, c, cols) for c in range(cols)] for r in range(rows)],
        dtype=torch.long,
    )
    return raw[index]


@pytest.mark.parametrize("rows", [1, 32, 33, 128, 200, 257])
@pytest.mark.parametrize("cols", [1, 3, 4, 9])
def test_swizzle_matches_the_cublas_layout(rows, cols):
    torch.manual_seed(rows * 10 + cols)
    scales = torch.randint(1, 256, (rows, cols), dtype=torch.uint8)
    out = swizzle_32_4_4(scales)
    assert out.dtype == torch.uint8 and out.dim() == 1
    pr, pc = padded_scale_shape(rows, cols)
    assert out.numel() == pr * pc
    assert torch.equal(out.double(), swizzle_reference(scales))


def test_swizzle_keeps_the_scale_dtype_and_bits():
    torch.manual_seed(0)
    scales = (torch.rand(130, 6) * 400).to(torch.float8_e4m3fn)
    out = swizzle_32_4_4(scales)
    assert out.dtype == torch.float8_e4m3fn
    assert torch.equal(out.view(torch.uint8).double(), swizzle_reference(scales))
    assert torch.equal(unswizzle(out, 130, 6), scales.view(torch.uint8))


def test_swizzle_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match="one-byte scales"):
        swizzle_32_4_4(torch.ones(4, 4))
    with pytest.raises(ValueError, match="2D"):
        swizzle_32_4_4(torch.ones(4, dtype=torch.uint8))


def _decode(mat: torch.Tensor, fp4: bool) -> torch.Tensor:
    """Element values (float64) of row-major codes ``[rows, bytes]``."""
    if not fp4:
        return mat.double()
    raw = mat.view(torch.uint8).long()
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(raw.shape[0], -1)
    table = torch.tensor(E2M1, dtype=torch.float64)
    values = table[codes & 7]
    return torch.where(codes >= 8, -values, values)


def _scale_values(scale: torch.Tensor, fp4: bool) -> torch.Tensor:
    if fp4:
        return scale.view(torch.float8_e4m3fn).double()
    return torch.pow(2.0, scale.view(torch.uint8).double() - 127)  # E8M0


def product_from_kernel_args(args: dict) -> torch.Tensor:
    """``a @ b.T`` from ``F.scaled_mm``'s arguments alone, in float64."""
    mat_a, mat_b = args["mat_a"], args["mat_b"].t()  # both row-major [rows, K bytes]
    fp4 = mat_a.dtype == torch.float4_e2m1fn_x2
    block = 16 if fp4 else 32
    operands = []
    for mat, scales in ((mat_a, args["scale_a"]), (mat_b, args["scale_b"])):
        values = _decode(mat, fp4)
        rows, k = values.shape
        block_scales = unswizzle(scales[0], rows, k // block)
        per_element = _scale_values(block_scales, fp4).repeat_interleave(block, dim=1)
        values = values * per_element
        if fp4:
            values = values * scales[1].double()  # the FP32 tensor scale
        operands.append(values)
    return operands[0] @ operands[1].t()


def _operand_pairs(recipe, m, k, n):
    torch.manual_seed(m + k + n)
    x = fc.quantize(torch.randn(m, k), recipe, "input", columnwise=m % 32 == 0)
    w = fc.quantize(torch.randn(n, k) / 4, recipe, "weight", columnwise=True)
    pairs = [("forward", x, w)]
    if m % 32 == 0:
        g = fc.quantize(torch.randn(m, n), recipe, "grad_output", columnwise=True)
        pairs += [
            ("dgrad", g, w.t()),
            ("wgrad", g.columnwise_operand(), x.columnwise_operand()),
        ]
    return pairs


RECIPES = {
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(),
    "nvfp4_plain": fc.NVFP4BlockScaling(
        weight_2d_blocks=False, random_hadamard_transform=False, stochastic_rounding=False
    ),
}


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("m,k,n", [(64, 256, 128), (33, 128, 64), (160, 384, 32)])
def test_kernel_arguments_give_the_emulated_product(name, m, k, n):
    """The swizzled scales, packed codes and tensor scales the kernel would read give
    the emulated GEMM's product (both FP32-accumulated sums of the same terms)."""
    for gemm, a, b in _operand_pairs(RECIPES[name], m, k, n):
        args = microscaled_args(a, b)
        ours = product_from_kernel_args(args)
        emulated = fc.scaled_mm(a, b, out_dtype=torch.float32, backend="emulate").double()
        scale = ours.abs().max().item()
        torch.testing.assert_close(emulated, ours, rtol=1e-5, atol=1e-5 * scale, msg=gemm)


def _on_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, list):
        return [_on_meta(v) for v in value]
    return value


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("m,k,n", [(64, 256, 128), (33, 128, 64), (160, 384, 32)])
def test_torch_meta_checks_accept_the_arguments(name, m, k, n):
    """``F.scaled_mm`` on meta tensors runs the CUDA checks (shapes, dtypes, swizzle,
    layouts) of torch's block-scaled path on exactly these arguments."""
    for _, a, b in _operand_pairs(RECIPES[name], m, k, n):
        args = {key: _on_meta(v) for key, v in microscaled_args(a, b).items()}
        out = torch.nn.functional.scaled_mm(**args, output_dtype=torch.bfloat16)
        assert out.shape == (a.data.reshape(-1, a.data.shape[-1]).shape[0], b.shape[0])
        assert out.dtype == torch.bfloat16


def test_leading_dimensions_are_flattened_into_rows():
    recipe = RECIPES["mxfp8"]
    torch.manual_seed(5)
    x = fc.quantize(torch.randn(2, 24, 64), recipe, "input")
    w = fc.quantize(torch.randn(32, 64), recipe, "weight")
    args = microscaled_args(x, w)
    assert args["mat_a"].shape == (48, 64)
    emulated = fc.scaled_mm(x, w, out_dtype=torch.float32, backend="emulate")
    ours = product_from_kernel_args(args)
    torch.testing.assert_close(emulated.reshape(48, 32).double(), ours, rtol=1e-5, atol=1e-4)
