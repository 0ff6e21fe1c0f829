"""The Inductor-compiled quantize operators (``fastcast.kernels.inductor``: what CUDA runs,
and every device under ``FASTCAST_KERNELS=compiled``) against the PyTorch reference, bit
for bit, and the choice that hands them out.

Compiling costs seconds per graph, and shapes are symbolic: each test runs one quantizer
over all its shapes and dtypes, so the file compiles each operator a few times only (a
graph per dtype, format, flag set, input rank and edge-tile pattern). The CUDA tests at
the end run on a machine with a GPU (``pytest -m gpu``).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

import fastcast as fc
from fastcast.kernels import choice
from fastcast.kernels import inductor as compiled
from fastcast.quantizers.block import BlockScalingQuantizer
from fastcast.quantizers.mx import MXFP8Quantizer
from fastcast.quantizers.nvfp4 import NVFP4Quantizer
from fastcast.quantizers.rowwise import RowwiseQuantizer
from fastcast.quantizers.tensorwise import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    quantize_with_scale,
    record_amax,
)

pytestmark = pytest.mark.compile

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (3.4e38 and the FP32 max: power-of-two scales and MXFP8's rceil must keep them finite.)
SPECIALS = (0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-45, -1e-40, 3e38, -3e38)
SPECIALS += (3.4e38, -torch.finfo(torch.float32).max)


@pytest.fixture(scope="module")
def modes():
    """A setter for ``FASTCAST_KERNELS`` for the whole module (restored after it), and
    Dynamo's caches emptied before and after, so the graphs compiled here are this
    module's alone."""
    import torch._dynamo  # noqa: PLC0415 - only the compile tests pay for it

    saved = os.environ.get("FASTCAST_KERNELS")
    torch._dynamo.reset()

    def set_mode(mode: str) -> None:
        os.environ["FASTCAST_KERNELS"] = mode
        choice.refresh()

    yield set_mode
    if saved is None:
        os.environ.pop("FASTCAST_KERNELS", None)
    else:
        os.environ["FASTCAST_KERNELS"] = saved
    choice.refresh()
    torch._dynamo.reset()


def _both(modes, run, device="cpu"):
    """``run()`` under the reference, then under the compiled operators (checking that
    they are the ones handed out for ``device``: on CUDA ``auto`` picks the native
    kernels where they are built, so ``compiled`` names Inductor's)."""
    modes("reference")
    want = run()
    modes("compiled")
    assert (
        choice.fused_op("quantize_tensorwise", torch.empty(1, device=device))
        is (compiled.ops()["quantize_tensorwise"])
    )
    got = run()
    return want, got


def _sample(shape, dtype, seed, device="cpu"):
    """Normal values over 40 decades, with zeros, infinities, NaNs of both signs, FP32
    subnormals and near-max values at the front."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(n, generator=gen) * torch.logspace(-20, 20, n)[torch.randperm(n, generator=gen)]
    k = min(len(SPECIALS), n)
    x[:k] = torch.tensor(SPECIALS[:k])
    return x.reshape(shape).to(dtype=dtype, device=device, copy=True)  # not a view


def _sample_blocks(shape, dtype, seed, block, device="cpu"):
    """Normal values scaled per block (one block all zero, one holding an inf, one a NaN,
    one tiny, one huge), so every block gets a scale of its own."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    x = torch.randn(rows, cols, generator=gen)
    br, bk = block
    grid = (-(-rows // br), -(-cols // bk))
    logs = torch.randint(-30, 30, grid, generator=gen).float()
    x *= torch.pow(10.0, logs).repeat_interleave(br, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    x[:br, :bk] = 0.0
    x[-1, -1] = math.inf
    x[0, -1] = -math.nan
    x[-1, 0] = -math.inf if rows * cols > 2 * bk else x[-1, 0]
    if grid[0] > 2:  # a block near the dtype's max (finite: it must dequantize finite)
        x[br : 2 * br, :bk] = float(torch.finfo(dtype).max) * 0.999
    return x.reshape(shape).to(dtype=dtype, device=device, copy=True)  # not a view


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same_tensor(got, want, what, any_nan=False):
    """The same shape, dtype, device and bytes. ``any_nan``: NaNs in the same places, but
    their sign and payload free (every other byte must match)."""
    assert (got is None) == (want is None), what
    if want is None:
        return
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert got.device == want.device, what
    got_bytes, want_bytes = _bytes(got), _bytes(want)
    if any_nan and want.is_floating_point():
        nan = want.float().isnan()
        assert torch.equal(got.float().isnan(), nan), what
        keep = ~nan.reshape(-1).repeat_interleave(want.element_size())
        got_bytes, want_bytes = got_bytes[keep], want_bytes[keep]
    assert torch.equal(got_bytes, want_bytes), what


def _assert_same(got, want, what="") -> None:
    """Two quantized tensors hold the same bytes in every layout (and dequantize alike)."""
    assert type(got) is type(want), what
    for name in ("shape", "dtype", "fmt", "block", "block_t"):
        assert getattr(got, name) == getattr(want, name), f"{what}: {name}"
    # The reference leaves a 16-bit NaN's sign to ATen's widening (its scalar path makes
    # it positive, its vectorised path keeps it: tests/kernels/test_kernels.py).
    from_16bit = want.dtype != torch.float32
    for name in type(want).inner_names:
        _assert_same_tensor(getattr(got, name), getattr(want, name), f"{what}: {name}", from_16bit)


def _quantize_all(quantizer, inputs, dequantize=True, **kwargs):
    out = []
    for x in inputs:
        q = quantizer.quantize(x, **kwargs)
        out.append((q, q.dequantize(torch.float32) if dequantize else None))
    return out


def _assert_all_same(got, want):
    for i, ((q, d), (q_ref, d_ref)) in enumerate(zip(got, want, strict=True)):
        _assert_same(q, q_ref, f"input {i}")
        # Finite inputs stay finite (near the FP32 max too): every dequantized inf here
        # comes from an input inf, so each is E5M2's (E4M3 makes NaN of it).
        if d is not None and q.fmt == "e4m3":
            assert not bool(d.isinf().any()), f"input {i}: a finite value became inf"
        # (A NaN's payload is not a value: the dequantized NaNs may differ in it.)
        _assert_same_tensor(d, d_ref, f"input {i}: dequantized", any_nan=True)


# -- every operator against the reference (CPU) -----------------------------------------
# Each case list pairs a dtype with one format and flag set (each pair is a graph); the
# ranks and the edge-tile patterns of the shapes are chosen to reuse graphs.
@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
def test_tensorwise_current_and_given_scales(modes):
    current = [(torch.float32, "e4m3", [(7,), (300,), (3, 5, 129), (2, 3, 40)])]
    current += [(torch.bfloat16, "e5m2", [(33, 17), (48, 96)])]
    given = [(torch.float32, "e4m3", [(33, 17), (64, 128)])]
    given += [(torch.bfloat16, "e5m2", [(3, 5, 129), (2, 3, 40)])]

    def run():
        out = []
        for (dtype, fmt, shapes), scales in [(c, None) for c in current] + [
            (g, (7.5, 1e30)) for g in given
        ]:
            for i, shape in enumerate(shapes):
                for x in (_sample(shape, dtype, i), torch.zeros(shape, dtype=dtype)):
                    if scales is None:
                        qs = [CurrentScalingQuantizer(fmt).quantize(x, columnwise=True)]
                    else:  # a delayed scale, and one whose products overflow FP32
                        qs = [
                            quantize_with_scale(x, torch.tensor([s]), fmt, True, True)
                            for s in scales
                        ]
                    # (The dequantization graphs: once per format and scale shape.)
                    out += [(q, q.dequantize(torch.float32) if fmt == "e4m3" else None) for q in qs]
        return out

    want, got = _both(modes, run)
    _assert_all_same(got, want)


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
def test_tensorwise_operator_layouts(modes):
    # The operator's own flags: the transposed layout it writes, the one left empty.
    x = _sample((3, 5, 64), torch.float32, 3)
    modes("compiled")
    op = choice.fused_op("quantize_tensorwise", x)
    data, scale_inv, data_t = op(x, None, torch.float8_e4m3fn, True, 1e-3, False, True)
    assert data.shape == (0,) and data_t.shape == (64, 15)
    modes("reference")
    want = CurrentScalingQuantizer("e4m3", True, 1e-3).quantize(x, columnwise=True)
    _assert_same_tensor(data_t, want.data_t, "data_t")
    _assert_same_tensor(scale_inv, want.scale_inv, "scale_inv")


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
def test_record_amax(modes):
    def run():
        slots = torch.zeros(3, 4)
        for dtype in (torch.float32, torch.bfloat16):
            for i, shape in enumerate([(2, 10, 20), (4, 11, 33), (3, 0, 5)]):
                x = _sample(shape, dtype, 10 + i)
                record_amax(slots[0, i : i + 1], x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))
                record_amax(slots[1, i : i + 1], x)  # non-finite: records nothing
                record_amax(slots[2, i : i + 1], torch.full(shape, i + 1.0, dtype=dtype))
        return slots

    want, got = _both(modes, run)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(want[1], torch.zeros(4))  # the cases are what they say
    assert torch.equal(want[2], torch.tensor([1.0, 2.0, 0.0, 0.0]))  # (3, 0, 5): empty


@pytest.mark.slow  # 20-50 s of Inductor compiles on two cores
def test_block_scaling(modes):
    # 1x128 tiles, both layouts (the column-wise one quantizes the transposed view);
    # 128x128 tiles, whose column-wise layout is the row-wise one transposed. Every
    # shape has full and partial tiles along both dims.
    cases = [
        (torch.float32, BlockScalingQuantizer("e4m3", 1, True), [(300, 200), (2, 150, 270)]),
        (torch.bfloat16, BlockScalingQuantizer("e5m2", 2, False), [(260, 300), (390, 270)]),
    ]

    def run():
        out = []
        for dtype, q, shapes in cases:
            inputs = [_sample_blocks(s, dtype, i, q.block) for i, s in enumerate(shapes)]
            out += _quantize_all(q, inputs, q.fmt == "e4m3", columnwise=True)
        return out

    want, got = _both(modes, run)
    _assert_all_same(got, want)


@pytest.mark.slow  # 30 s of Inductor compiles on two cores
def test_mxfp8(modes):
    cases = [
        (torch.float32, MXFP8Quantizer("e4m3", "rceil"), True, [(64, 96), (2, 48, 160)]),
        (torch.bfloat16, MXFP8Quantizer("e5m2", "ocp"), False, [(32, 64), (96, 160)]),
    ]

    def run():
        out = []
        for dtype, q, columnwise, shapes in cases:
            inputs = [_sample_blocks(s, dtype, i, (1, 32)) for i, s in enumerate(shapes)]
            out += _quantize_all(q, inputs, q.fmt == "e4m3", columnwise=columnwise)
        return out

    want, got = _both(modes, run)
    _assert_all_same(got, want)


@pytest.mark.slow  # 20-50 s of Inductor compiles on two cores
def test_nvfp4(modes):
    # 1x16 with stochastic rounding (gradients), both layouts, 3-D inputs; 16x16 tiles to
    # nearest (weights), both layouts.
    cases = [
        (torch.float32, NVFP4Quantizer(False, True), [(2, 16, 48), (3, 32, 64)]),
        (torch.bfloat16, NVFP4Quantizer(True, False), [(32, 48), (64, 32)]),
    ]

    def run():
        out = []
        gen = torch.Generator().manual_seed(5)
        for dtype, q, shapes in cases:
            inputs = [_sample_blocks(s, dtype, i, (1, 16)) for i, s in enumerate(shapes)]
            out += _quantize_all(q, inputs, columnwise=True, generator=gen)
        return out, gen.get_state()

    (want, want_state), (got, got_state) = _both(modes, run)
    _assert_all_same(got, want)
    assert torch.equal(got_state, want_state)  # the same draws, from the same generator


@pytest.mark.slow  # 20-50 s of Inductor compiles on two cores
def test_rowwise(modes):
    # Per row and per column (the column-wise layout), power-of-2 and FP32 scales.
    cases = [
        (torch.float32, RowwiseQuantizer("e4m3", True), [(33, 70), (2, 17, 40)]),
        (torch.bfloat16, RowwiseQuantizer("e5m2", False), [(16, 40), (48, 24)]),
    ]

    def run():
        out = []
        for dtype, q, shapes in cases:
            inputs = [_sample(s, dtype, 20 + i) for i, s in enumerate(shapes)]
            out += _quantize_all(q, inputs, q.fmt == "e4m3", columnwise=True)
        return out

    want, got = _both(modes, run)
    _assert_all_same(got, want)


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
def test_delayed_quantize_records_and_casts(modes):
    # Delayed scaling's one-pass operator: the codes with the scale given, and the slot.
    def run():
        meta = SimpleNamespace(
            scale_views=list(torch.tensor([0.5, 3e30]).split(1)),
            amax_slots=list(torch.zeros(2).split(1)),
        )
        out = []
        for i, shape in enumerate([(7, 40), (3, 5, 129)]):
            for index, fmt in ((0, "e4m3"), (1, "e5m2")):
                x = _sample(shape, torch.float32, 30 + i).nan_to_num(posinf=1.0, neginf=-1.0)
                q = DelayedScalingQuantizer(meta, index, fmt).quantize(x, columnwise=True)
                out.append((q, None))
        return out, torch.cat(meta.amax_slots)

    (want, want_slots), (got, got_slots) = _both(modes, run)
    _assert_all_same(got, want)
    assert torch.equal(got_slots.view(torch.int32), want_slots.view(torch.int32))


def test_linear_forward_and_backward(modes):
    # Per-tensor E4M3 scaling: the input and grad (3-D) and the weight (2-D) quantize
    # through graphs the tensorwise test compiled.
    x = torch.randn(4, 16, 64)
    recipe = fc.recipe.Float8CurrentScaling(fp8_format=fc.recipe.Format.E4M3)

    def run():
        torch.manual_seed(0)
        layer = fc.Linear(64, 32)
        xg = x.clone().requires_grad_(True)
        with fc.autocast(recipe=recipe):
            out = layer(xg)
        out.square().sum().backward()
        return out, xg.grad, layer.weight.grad, layer.bias.grad

    want, got = _both(modes, run)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


# -- the choice ---------------------------------------------------------------------------
def test_cuda_choice_without_triton(monkeypatch, modes):
    # Where Inductor cannot emit Triton, CUDA tensors take the reference: after one
    # warning under auto, an error where an implementation was asked for.
    monkeypatch.setattr(choice, "_triton_missing", lambda: "no triton here")
    modes("auto")
    with pytest.warns(RuntimeWarning, match="no triton here"):
        assert choice._resolve_cuda() == {}
    assert choice._cuda_ops == {}  # kept: later CUDA quantizes neither ask nor warn again
    for mode in ("fused", "compiled"):
        modes(mode)
        with pytest.raises(RuntimeError, match=f"FASTCAST_KERNELS={mode}.*no triton here"):
            choice._resolve_cuda()
    monkeypatch.setattr(choice, "_triton_missing", lambda: None)
    for mode in ("auto", "fused", "compiled"):
        modes(mode)
        # (A CPU torch builds no native CUDA kernels: every operator is the compiled one.)
        assert choice._resolve_cuda() == compiled.ops()
    modes("reference")
    assert choice._resolve_cuda() == {}


def test_cpu_choice(modes):
    x = torch.empty(1)
    modes("compiled")
    assert choice.fused_op("quantize_blocks", x) is compiled.ops()["quantize_blocks"]
    # No compiled GEMM: torch._scaled_mm computes the per-tensor product.
    assert choice.fused_op("scaled_mm_tensorwise", x) is None
    modes("reference")
    assert choice.fused_op("quantize_blocks", x) is None
    assert choice.fused_op("quantize_blocks", x.to("meta")) is None


# -- CUDA: the operators Inductor compiles to Triton, against the reference --------------
@pytest.mark.parametrize("per_function", [True, False], ids=["torch>=2.12", "torch<2.12"])
def test_each_operator_may_recompile_up_to_its_limit_on_any_torch(monkeypatch, per_function):
    """torch.compile takes ``recompile_limit`` from 2.12 on; before, the operators raise
    Dynamo's limit around their own calls only (torch 2.11 refused the keyword: every
    CUDA quantize failed on the first GPU run)."""
    seen = {}

    def fake_compile(fn, **kwargs):
        seen.update(kwargs)
        return lambda *args: torch._dynamo.config.recompile_limit

    monkeypatch.setattr(compiled, "_PER_FUNCTION_LIMIT", per_function)
    monkeypatch.setattr(torch, "compile", fake_compile)
    op = compiled._compile("quantize_rows", compiled.quantize_rows)
    limit_inside = op(torch.zeros(2, 2), torch.float8_e4m3fn, False, False)
    if per_function:
        assert seen["recompile_limit"] == compiled.RECOMPILE_LIMIT and seen["isolate_recompiles"]
    else:
        assert "recompile_limit" not in seen and limit_inside == compiled.RECOMPILE_LIMIT
        assert torch._dynamo.config.recompile_limit != compiled.RECOMPILE_LIMIT  # restored


@pytest.mark.gpu
@needs_cuda
def test_cuda_operators_match_reference(modes):
    def run():
        out = []
        for dtype in (torch.float32, torch.bfloat16):
            x = _sample((3, 32, 256), dtype, 1, "cuda")
            blocks = _sample_blocks((300, 200), dtype, 2, (1, 128), "cuda")
            quantizers = [
                CurrentScalingQuantizer("e4m3"),
                BlockScalingQuantizer("e4m3", 1),
                BlockScalingQuantizer("e5m2", 2),
                MXFP8Quantizer("e4m3"),
                MXFP8Quantizer("e5m2", "ocp"),
            ]
            for q in quantizers:
                inputs = [x, blocks] if not isinstance(q, MXFP8Quantizer) else [x]
                out += _quantize_all(q, inputs, columnwise=True)
            out += _quantize_all(_ScaledQuantizer(), [x, blocks], columnwise=True)
            gen = torch.Generator("cuda").manual_seed(3)
            for nv in (NVFP4Quantizer(False, True), NVFP4Quantizer(True, False)):
                q_kwargs = dict(columnwise=True, generator=gen)
                out += _quantize_all(nv, [x], dequantize=False, **q_kwargs)
            slot = torch.zeros(1, device="cuda")
            record_amax(slot, x)
            record_amax(slot, x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))
            out.append((slot, None))
        return out

    want, got = _both(modes, run, "cuda")
    for (q, d), (q_ref, d_ref) in zip(got, want, strict=True):
        if isinstance(q_ref, torch.Tensor):
            assert torch.equal(q.view(torch.int32), q_ref.view(torch.int32))
            continue
        _assert_same(q, q_ref)
        if d_ref is not None:
            _assert_same_tensor(d, d_ref, "dequantized", any_nan=True)


class _ScaledQuantizer:
    """quantize_with_scale with a delayed-scaling style scale on the device."""

    def quantize(self, x, *, rowwise=True, columnwise=False):
        scale = torch.tensor([7.5], device=x.device)
        return quantize_with_scale(x, scale, "e4m3", rowwise, columnwise)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "recipe",
    [
        fc.recipe.DelayedScaling(),
        fc.recipe.Float8CurrentScaling(),
        fc.recipe.Float8BlockScaling(),
        fc.recipe.MXFP8BlockScaling(),
        fc.recipe.NVFP4BlockScaling(),
    ],
    ids=lambda r: type(r).__name__,
)
def test_cuda_linear_matches_reference(modes, recipe):
    x = torch.randn(4, 32, 128, device="cuda")

    def run():
        # A fresh layer (delayed scaling's histories start empty); the seed fixes its
        # weights and the draws of NVFP4's stochastic rounding.
        torch.manual_seed(0)
        layer = fc.Linear(128, 64, device="cuda")
        xg = x.clone().requires_grad_(True)
        with fc.autocast(recipe=recipe):
            out = layer(xg)
        out.square().sum().backward()
        return out, xg.grad, layer.weight.grad, layer.bias.grad

    want, got = _both(modes, run, "cuda")
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
