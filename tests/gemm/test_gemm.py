"""fc.scaled_mm against a float64 dequantize-then-matmul reference.

The reference decodes every operand without fastcast: FP8 codes through
``fp8_reference``, E2M1 codes from their table, E8M0 scales as ``2**(b - 127)``, block
scales broadcast by their own index arithmetic, all in float64, where the products of an
FP8/FP4 value and an FP32 scale are exact. The matmul is then exact up to float64
rounding, far below what is checked.

Tolerance per output element: the FP32 computation rounds each dequantized operand (at
most two roundings each: scale product and element product), each product, each of the
K - 1 additions and the result, so ``|out - ref| <= (K + 6) * 2**-24 * sum_k |a_k| |b_k|``
(the classic dot-product bound ``gamma_K`` plus the operand roundings).
"""

from __future__ import annotations

import pytest
import torch
from fp8_reference import FMT_MAX, FP8, decode_fp8, encode_fp8, to_f32

import fastcast as fc
from fastcast import kernels
from fastcast.tensor import Float8Tensor, MXFP8Tensor, NVFP4Tensor

BACKENDS = ["hardware", "emulate"]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
U32 = 2.0**-24


# -- reference ---------------------------------------------------------------------------------
def expand(scales: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Per-block scales to one per element of ``[rows, cols]`` (0 = whole dimension)."""
    br, bk = block
    n_r = -(-rows // br) if br else 1
    n_c = -(-cols // bk) if bk else 1
    s = scales.reshape(n_r, n_c)
    r_idx = torch.arange(rows) // br if br else torch.zeros(rows, dtype=torch.long)
    c_idx = torch.arange(cols) // bk if bk else torch.zeros(cols, dtype=torch.long)
    return s[r_idx][:, c_idx]


def ref_matrix(q) -> torch.Tensor:
    """The row-wise layout of ``q`` as a float64 ``[R, K]`` matrix, decoded from bits."""
    data = q.data
    if isinstance(q, NVFP4Tensor):
        packed = data.reshape(-1, data.shape[-1]).to(torch.int64)
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
        values = E2M1[codes & 7] * torch.where(codes & 8 != 0, -1.0, 1.0).double()
        scales = decode_fp8(q.scale_inv.view(torch.uint8), "e4m3") * q.global_scale_inv.item()
    else:
        codes = data.reshape(-1, data.shape[-1]).view(torch.uint8)
        values = decode_fp8(codes, q.fmt)
        if isinstance(q, MXFP8Tensor):
            scales = torch.pow(2.0, q.scale_inv.double() - 127)
        else:
            scales = q.scale_inv.double()
    rows, cols = values.shape
    return values * expand(scales, q.block, rows, cols)


def ref_mm(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a @ b.T in float64, the FP32 error bound per element)``."""
    am, bm = ref_matrix(a), ref_matrix(b)
    k = am.shape[1]
    return am @ bm.t(), (k + 6) * U32 * (am.abs() @ bm.abs().t())


def assert_fp32_close(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    assert out.dtype == torch.float32
    err = (out.double().reshape(ref.shape) - ref).abs()
    assert bool(torch.isfinite(out).all())
    worst = float((err - bound).max())
    assert worst <= 0.0, f"error exceeds the FP32 bound by {worst}"


def ordered(t: torch.Tensor) -> torch.Tensor:
    """16-bit float codes mapped to integers in value order (adjacent values differ by 1)."""
    bits = t.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_correctly_rounded(out: torch.Tensor, ref: torch.Tensor, min_fraction=0.98) -> None:
    """A 16-bit output is ref rounded once, but for rare one-ulp FP32-rounding misses."""
    expected = ref.to(out.dtype).reshape(out.shape)  # one rounding from float64
    steps = (ordered(out) - ordered(expected)).abs()
    assert int(steps.max()) <= 1, "more than one ulp from the correctly rounded value"
    assert float((steps == 0).double().mean()) >= min_fraction


def sample(shape, dtype=torch.float32, seed=0, spread=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    k = torch.randint(-spread, spread + 1, tuple(shape[:-1]) + (1,), generator=g)
    return (x * torch.pow(2.0, k.double())).to(dtype)


def quantize_per_row(x: torch.Tensor, fmt: str) -> Float8Tensor:
    """One FP32 scale per row (``fmt_max / amax_row``), quantized by the test's reference."""
    m = x.double()
    amax = m.abs().amax(dim=1, keepdim=True)
    scale = torch.tensor([[to_f32(FMT_MAX[fmt] / v)] for v in amax.flatten().tolist()])
    codes = encode_fp8((m * scale.double()).float().double(), fmt)
    return Float8Tensor(
        fmt=fmt,
        shape=x.shape,
        dtype=x.dtype,
        data=codes.view(FP8[fmt]),
        scale_inv=(1.0 / scale.double()).float(),
        block=(1, 0),
    )


CURRENT = fc.Float8CurrentScaling()  # HYBRID: E4M3 forward, E5M2 gradients


def tensorwise(x, role="input", **kw):
    return fc.quantize(x, CURRENT, role, **kw)


def no_kernel(*args, **kwargs):
    raise AssertionError("torch._scaled_mm must not be called here")


# -- numerics: the hardware (CPU kernel) and emulated paths -----------------------------------
@pytest.mark.parametrize("shape", [(48, 32, 160), (33, 21, 100), (1, 1, 16)])
@pytest.mark.parametrize("a_role", ["input", "grad_output"])
@pytest.mark.parametrize("backend", BACKENDS + [None])
def test_tensorwise_matches_reference(backend, a_role, shape):
    m, n, k = shape
    a = tensorwise(sample((m, k), seed=1), a_role)
    b = tensorwise(sample((n, k), seed=2), "weight")
    assert a.fmt == ("e5m2" if a_role == "grad_output" else "e4m3") and b.fmt == "e4m3"
    out = fc.scaled_mm(a, b, backend=backend)
    assert out.shape == (m, n)
    ref, bound = ref_mm(a, b)
    assert_fp32_close(out, ref, bound)


@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
@pytest.mark.parametrize("backend", BACKENDS + [None])
def test_per_row_scaled_operands(backend, fmts):
    a = quantize_per_row(sample((40, 96), seed=3, spread=6), fmts[0])
    b = quantize_per_row(sample((24, 96), seed=4, spread=6), fmts[1])
    assert a.scale_inv.shape == (40, 1) and b.scale_inv.shape == (24, 1)
    out = fc.scaled_mm(a, b, backend=backend)
    ref, bound = ref_mm(a, b)
    assert_fp32_close(out, ref, bound)
    # the per-row scales matter: one shared scale would be far off for these rows
    assert len(set(a.scale_inv.flatten().tolist())) > 3


def test_per_row_3d_operand_on_both_backends():
    x = sample((2, 20, 64), seed=5, spread=5)
    a2 = quantize_per_row(x.reshape(40, 64), "e4m3")
    a = Float8Tensor(
        fmt="e4m3",
        shape=x.shape,
        dtype=x.dtype,
        data=a2.data.reshape(x.shape),
        scale_inv=a2.scale_inv,
        block=(1, 0),
    )
    b = quantize_per_row(sample((24, 64), seed=6), "e4m3")
    ref, bound = ref_mm(a2, b)
    for backend in BACKENDS:
        out = fc.scaled_mm(a, b, backend=backend)
        assert out.shape == (2, 20, 24) and out._base is None
        assert_fp32_close(out, ref, bound)


RECIPES = {
    "block-1x128-w128x128": fc.Float8BlockScaling(),
    "block-f32-scales": fc.Float8BlockScaling(use_f32_scales=True, w_block_scaling_dim=1),
    "mxfp8": fc.MXFP8BlockScaling(),
    "mxfp8-hybrid": fc.MXFP8BlockScaling(fp8_format=fc.Format.HYBRID),
    "nvfp4": fc.NVFP4BlockScaling(),
    "nvfp4-1d": fc.NVFP4BlockScaling(weight_2d_blocks=False),
}
FAMILY = {
    Float8Tensor: "blockwise",
    MXFP8Tensor: "mxfp8",
    NVFP4Tensor: "nvfp4",
}


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("a_role", ["input", "grad_output"])
def test_block_families_emulate(name, a_role, monkeypatch):
    recipe = RECIPES[name]
    # K = 320: whole MX/NVFP4 blocks, a partial 1x128 tile; N = 48: a partial 128x128 tile
    a = fc.quantize(sample((64, 320), seed=7, spread=5), recipe, a_role)
    b = fc.quantize(sample((48, 320), seed=8, spread=5), recipe, "weight")
    assert type(a) is type(b) and type(a) in FAMILY
    ref, bound = ref_mm(a, b)
    # backend=None on CPU emulates these families: torch._scaled_mm is never called
    monkeypatch.setattr(torch, "_scaled_mm", no_kernel)
    for backend in ("emulate", None):
        assert_fp32_close(fc.scaled_mm(a, b, backend=backend), ref, bound)
    with pytest.raises(RuntimeError, match=FAMILY[type(a)]):
        fc.scaled_mm(a, b, backend="hardware")


def test_block_tiles_really_differ():
    # The reference must see the 1x128 / 128x128 structure: scales vary across tiles.
    x = sample((64, 320), seed=9, spread=5)
    q = fc.quantize(x, fc.Float8BlockScaling(), "input")
    assert q.block == (1, 128) and q.scale_inv.shape == (64, 3)
    w = fc.quantize(sample((200, 320), seed=10), fc.Float8BlockScaling(), "weight")
    assert w.block == (128, 128) and w.scale_inv.shape == (2, 3)
    assert len(set(q.scale_inv.flatten().tolist())) > 3


@pytest.mark.parametrize("b_recipe", ["mxfp8", "per-row", "nvfp4"])
def test_mixed_families_emulate(b_recipe, monkeypatch):
    a = tensorwise(sample((32, 64), seed=11))
    w = sample((32, 64), seed=12)
    if b_recipe == "per-row":
        b = quantize_per_row(w, "e4m3")
    else:
        b = fc.quantize(w, RECIPES[b_recipe], "weight")
    ref, bound = ref_mm(a, b)
    monkeypatch.setattr(torch, "_scaled_mm", no_kernel)
    for backend in ("emulate", None):
        assert_fp32_close(fc.scaled_mm(a, b, backend=backend), ref, bound)
        assert_fp32_close(fc.scaled_mm(b, a, backend=backend), ref.t(), bound.t())
    with pytest.raises(RuntimeError, match="mixed"):
        fc.scaled_mm(a, b, backend="hardware")


# -- bias, output dtypes, accumulation ---------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_and_out_dtype(backend, bias_dtype, out_dtype):
    a = tensorwise(sample((64, 128), seed=13))
    b = tensorwise(sample((48, 128), seed=14), "weight")
    bias = None if bias_dtype is None else (sample((1, 48), seed=15) * 4).flatten().to(bias_dtype)
    out = fc.scaled_mm(a, b, out_dtype, bias=bias, backend=backend)
    assert out.dtype == out_dtype and out.shape == (64, 48)
    ref, bound = ref_mm(a, b)
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + U32 * ref.abs()  # the FP32 addition of the bias
    if out_dtype == torch.float32:
        assert_fp32_close(out, ref, bound)
    else:
        assert_correctly_rounded(out, ref)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_is_added_before_rounding(backend, bias_dtype):
    # a . b = 1 + 2**-8 + 2**-12 exactly; with bias -1 the exact result 2**-8 + 2**-12 is a
    # bfloat16 value. Rounding the product first (to 1 + 2**-7) would give 2**-7.
    e4m3 = torch.float8_e4m3fn
    a = Float8Tensor(
        fmt="e4m3",
        shape=(1, 3),
        dtype=torch.float32,
        data=torch.tensor([[1.0, 0.25, 2.0**-6]]).to(e4m3),
        scale_inv=torch.tensor(1.0),
    )
    b = Float8Tensor(
        fmt="e4m3",
        shape=(2, 3),
        dtype=torch.float32,
        data=torch.tensor([[1.0, 2.0**-6, 2.0**-6], [1.0, 0.0, 0.0]]).to(e4m3),
        scale_inv=torch.tensor(1.0),
    )
    bias = torch.tensor([-1.0, 0.5], dtype=bias_dtype)
    out = fc.scaled_mm(a, b, torch.bfloat16, bias=bias, backend=backend)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [[2.0**-8 + 2.0**-12, 1.5]]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("backend", BACKENDS + [None])
def test_accumulate_adds_in_place(backend, with_bias):
    a = tensorwise(sample((40, 96), seed=16))
    b = tensorwise(sample((24, 96), seed=17), "weight")
    buf = sample((40, 24), seed=18) * 10
    start = buf.clone()
    bias = sample((1, 24), seed=19).flatten() if with_bias else None
    res = fc.scaled_mm(a, b, bias=bias, accumulate=buf, backend=backend)
    assert res is buf
    ref, bound = ref_mm(a, b)
    if bias is not None:
        ref = ref + bias.double()
    once = ref + start.double()
    # the product's bound, plus the FP32 roundings of the bias and buffer additions
    slack = 2 * U32 * (once.abs() + ref.abs() + start.double().abs())
    assert_fp32_close(buf, once, bound + slack)
    # a second call keeps accumulating
    fc.scaled_mm(a, b, bias=bias, accumulate=buf, backend=backend)
    twice = once + ref
    assert_fp32_close(buf, twice, 2 * (bound + slack) + U32 * twice.abs())


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_with_3d_a(backend):
    a = tensorwise(sample((2, 16, 64), seed=20))
    b = tensorwise(sample((8, 64), seed=21), "weight")
    buf = torch.zeros(2, 16, 8)
    res = fc.scaled_mm(a, b, accumulate=buf, backend=backend)
    assert res is buf
    ref, bound = ref_mm(a, b)
    assert_fp32_close(buf.reshape(32, 8), ref, bound)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS + [None])
def test_3d_a_keeps_leading_dims_and_is_not_a_view(backend, out_dtype):
    a = tensorwise(sample((3, 10, 64), seed=22))
    b = tensorwise(sample((12, 64), seed=23), "weight")
    bias = torch.ones(12, dtype=out_dtype)
    out = fc.scaled_mm(a, b, out_dtype, bias=bias, backend=backend)
    assert out.shape == (3, 10, 12) and out.dtype == out_dtype
    assert out._base is None and out.is_contiguous()
    ref, bound = ref_mm(a, b)
    ref = (ref + 1).reshape(3, 10, 12)
    if out_dtype == torch.float32:
        assert_fp32_close(out, ref, bound.reshape(3, 10, 12) + U32 * ref.abs())
    else:
        assert_correctly_rounded(out, ref)
    before = out.clone()
    out += 1  # in-place ops after the GEMM (residual adds, inplace ReLU) must work
    out.relu_()
    assert torch.equal(out, (before + 1).relu())


def test_1d_a():
    x = sample((1, 64), seed=24).flatten()
    a = tensorwise(x)
    b = tensorwise(sample((12, 64), seed=25), "weight")
    ref, bound = ref_mm(a, b)
    for backend in BACKENDS:
        out = fc.scaled_mm(a, b, backend=backend)
        assert out.shape == (12,)
        assert_fp32_close(out, ref.flatten(), bound.flatten())


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_operands(backend):
    def zeros(shape):
        data = torch.zeros(shape).to(torch.float8_e4m3fn)
        return Float8Tensor(
            fmt="e4m3", shape=shape, dtype=torch.float32, data=data, scale_inv=torch.tensor(0.5)
        )

    assert fc.scaled_mm(zeros((0, 16)), zeros((4, 16)), backend=backend).shape == (0, 4)
    assert fc.scaled_mm(zeros((2, 0, 16)), zeros((4, 16)), backend=backend).shape == (2, 0, 4)
    assert fc.scaled_mm(zeros((3, 16)), zeros((0, 16)), backend=backend).shape == (3, 0)
    # K = 0: an empty sum is zero, plus the bias
    out = fc.scaled_mm(zeros((3, 0)), zeros((4, 0)), bias=torch.ones(4), backend=backend)
    assert torch.equal(out, torch.ones(3, 4))


# -- backend selection -------------------------------------------------------------------------
def test_auto_uses_the_cpu_kernel_for_tensorwise(monkeypatch, gemm_mode):
    # Without the fused kernels (tests/kernels/test_kernels.py checks that theirs is equal).
    monkeypatch.setenv("FASTCAST_KERNELS", "reference")
    kernels.refresh()
    monkeypatch.setattr(kernels.choice, "_cpu_ops", None)  # chosen again after the test too
    gemm_mode("auto")
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    a = tensorwise(sample((16, 32), seed=26))
    b = tensorwise(sample((8, 32), seed=27), "weight")
    fc.scaled_mm(a, b)
    assert calls == [1]
    fc.scaled_mm(a, b, backend="emulate")
    assert calls == [1]


@pytest.mark.parametrize("gemm_mode", ["emulate"], indirect=True)
def test_fastcast_gemm_emulate_skips_the_kernel(gemm_mode, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", no_kernel)
    a = tensorwise(sample((16, 32), seed=28))
    b = tensorwise(sample((8, 32), seed=29), "weight")
    ref, bound = ref_mm(a, b)
    assert_fp32_close(fc.scaled_mm(a, b), ref, bound)
    rows_a = quantize_per_row(sample((16, 32), seed=40), "e4m3")
    rows_b = quantize_per_row(sample((8, 32), seed=41), "e4m3")
    assert_fp32_close(fc.scaled_mm(rows_a, rows_b), *ref_mm(rows_a, rows_b))


def test_fastcast_gemm_hardware_refuses_to_emulate(gemm_mode):
    gemm_mode("hardware")
    a = fc.quantize(sample((32, 64), seed=30), fc.MXFP8BlockScaling())
    b = fc.quantize(sample((32, 64), seed=31), fc.MXFP8BlockScaling(), "weight")
    with pytest.raises(RuntimeError, match="mxfp8.*FASTCAST_GEMM"):
        fc.scaled_mm(a, b)
    # an explicit backend still wins
    ref, bound = ref_mm(a, b)
    assert_fp32_close(fc.scaled_mm(a, b, backend="emulate"), ref, bound)


# -- errors ------------------------------------------------------------------------------------
def test_errors():
    x = sample((8, 32), seed=32)
    a = tensorwise(x)
    b = tensorwise(sample((4, 32), seed=33), "weight")
    with pytest.raises(TypeError, match="quantized"):
        fc.scaled_mm(x, b)
    with pytest.raises(TypeError, match="quantized"):
        fc.scaled_mm(a, x[:4])
    b16 = tensorwise(sample((4, 16), seed=34), "weight")
    with pytest.raises(ValueError, match=r"\(8, 32\).*\(4, 16\)"):
        fc.scaled_mm(a, b16)
    b3 = tensorwise(sample((2, 4, 32), seed=35), "weight")
    with pytest.raises(ValueError, match="2D"):
        fc.scaled_mm(a, b3)
    only_t = tensorwise(x, rowwise=False, columnwise=True)
    for args in ((only_t, b), (b, only_t)):
        with pytest.raises(ValueError, match="row-?wise.*column-?wise"):
            fc.scaled_mm(*args)
    with pytest.raises(ValueError, match="backend"):
        fc.scaled_mm(a, b, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        fc.scaled_mm(a, b, backend="Emulate")


# -- backward-style products -------------------------------------------------------------------
BACKWARD = {
    "tensorwise": (CURRENT, ["hardware", "emulate", None]),
    "block": (fc.Float8BlockScaling(fp8_format=fc.Format.HYBRID), ["emulate", None]),
    "mxfp8": (fc.MXFP8BlockScaling(fp8_format=fc.Format.HYBRID), ["emulate", None]),
    "nvfp4": (fc.NVFP4BlockScaling(), ["emulate", None]),
}


@pytest.mark.parametrize("lead", [(64,), (2, 32)])
@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_dgrad_and_wgrad(name, lead):
    recipe, backends = BACKWARD[name]
    n, k = 64, 96
    x = fc.quantize(sample(lead + (k,), seed=36), recipe, "input", columnwise=True)
    w = fc.quantize(sample((n, k), seed=37), recipe, "weight", columnwise=True)
    g = fc.quantize(sample(lead + (n,), seed=38), recipe, "grad_output", columnwise=True)
    if name != "nvfp4":
        assert g.fmt == "e5m2" and w.fmt == "e4m3"
    w_t = w.t()
    assert w_t.shape == (k, n)
    g_cols, x_cols = g.columnwise_operand(), x.columnwise_operand()
    assert g_cols.shape == (n, 64) and x_cols.shape == (k, 64)
    # dgrad = g @ W and wgrad = g^T @ x, with the dequantized operands each GEMM is given
    dgrad_ref, dgrad_bound = ref_mm(g, w_t)
    wgrad_ref, wgrad_bound = ref_mm(g_cols, x_cols)
    if name == "tensorwise":
        # per-tensor layouts are exact transposes: the operands are the forward ones
        assert torch.equal(ref_matrix(w_t), ref_matrix(w).t())
        assert torch.equal(ref_matrix(g_cols), ref_matrix(g).t())
        assert torch.equal(ref_matrix(x_cols), ref_matrix(x).t())
    else:  # block formats quantize the other axis; still close to the true product
        exact = ref_matrix(g) @ ref_matrix(w)
        assert float((dgrad_ref - exact).norm() / exact.norm()) < 0.25
    for backend in backends:
        dgrad = fc.scaled_mm(g, w_t, backend=backend)
        assert dgrad.shape == lead + (k,)
        assert_fp32_close(dgrad.reshape(64, k), dgrad_ref, dgrad_bound)
        wgrad = fc.scaled_mm(g_cols, x_cols, backend=backend)
        assert wgrad.shape == (n, k)
        assert_fp32_close(wgrad, wgrad_ref, wgrad_bound)
        # accumulate the weight gradient into an FP32 buffer, as a .grad would
        buf = torch.zeros(n, k)
        assert fc.scaled_mm(g_cols, x_cols, accumulate=buf, backend=backend) is buf
        assert_fp32_close(buf, wgrad_ref, wgrad_bound)


def test_reference_decoders_agree_with_torch_casts():
    # The independent decoders read the bits the way torch's FP8 dtypes define them ...
    x = sample((32, 64), seed=39)
    q = tensorwise(x)
    assert torch.equal(ref_matrix(q), q.data.double() * q.scale_inv.double())
    mx = fc.quantize(x, fc.MXFP8BlockScaling())
    mx_scales = torch.pow(2.0, mx.scale_inv.double() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(ref_matrix(mx), mx.data.double() * mx_scales)
    # ... and decode every family to what fastcast dequantizes to, up to FP32 rounding
    for recipe in RECIPES.values():
        for role in ("input", "weight"):
            q = fc.quantize(x, recipe, role)
            ref = ref_matrix(q)
            err = (q.dequantize(torch.float32).double() - ref).abs()
            assert bool((err <= 2 * U32 * ref.abs()).all()), (recipe, role)
            assert float(ref.abs().max()) > 0
