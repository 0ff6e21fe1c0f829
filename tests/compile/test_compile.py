"""``torch.compile(fullgraph=True)`` with ``fc.autocast`` inside and outside the compiled
region (Float8CurrentScaling): compiled runs match eager and recompile only when the
autocast state changes. Each compile costs seconds here, so the tests are few."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fastcast as fc
from fastcast.quantizers.block import BlockScalingQuantizer
from fastcast.quantizers.mx import MXFP8Quantizer
from fastcast.quantizers.rowwise import RowwiseQuantizer
from fastcast.quantizers.tensorwise import CurrentScalingQuantizer

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return fc.convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))


def _step(model, fn, x, recipe):
    """Loss and parameter gradients of one forward and backward."""
    for p in model.parameters():
        p.grad = None
    loss = fn(model, x, recipe)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _loss_inside(model, x, recipe):
    with fc.autocast(recipe=recipe):
        y = model(x)
    return y.square().mean()


def _assert_matches(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
def test_autocast_inside_compiled_function():
    model, x = _mlp(), torch.randn(32, 64)
    recipe = fc.Float8CurrentScaling()
    eager = _step(model, _loss_inside, x, recipe)
    high = _step(model, lambda m, x, r: m(x).square().mean(), x, recipe)
    assert not torch.equal(eager[0], high[0])  # FP8 ran: the comparison below means something

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_loss_inside, backend=counter, fullgraph=True)
    _assert_matches(_step(model, compiled, x, recipe), eager)
    _assert_matches(_step(model, compiled, x, fc.Float8CurrentScaling()), eager)
    assert counter.frame_count == 1  # the same recipe again, or an equal one: no recompile

    other = fc.Float8CurrentScaling(fp8_format=fc.Format.E4M3)
    _assert_matches(_step(model, compiled, x, other), _step(model, _loss_inside, x, other))
    _step(model, compiled, x, recipe)
    assert counter.frame_count == 2  # another recipe compiles once; the first is still cached


def test_compiled_model_under_eager_autocast():
    model, x = _mlp(), torch.randn(4, 8, 64)  # 3-D input: leading dims are flattened
    recipe = fc.Float8CurrentScaling()
    eager = _step(model, _loss_inside, x, recipe)
    high = _step(model, lambda m, x, r: m(x).square().mean(), x, recipe)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(copy.deepcopy(model), backend=counter, fullgraph=True)
    _assert_matches(_step(compiled, _loss_inside, x, recipe), eager)
    _assert_matches(_step(compiled, _loss_inside, x, fc.Float8CurrentScaling()), eager)
    assert counter.frame_count == 1
    # Outside any autocast the compiled model must run in high precision (a guard fails).
    _assert_matches(_step(compiled, lambda m, x, r: m(x).square().mean(), x, recipe), high)
    assert counter.frame_count == 2
    # Disabled autocast: high precision again, from its own graph.
    with fc.autocast(False, recipe=recipe):
        out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-7)
    _assert_matches(_step(compiled, _loss_inside, x, recipe), eager)
    assert counter.frame_count == 3


def test_compiled_quantize_codes_bitwise():
    x = torch.randn(48, 80) * 3
    x[0, 0] = float("inf")  # non-finite handling is traced too
    for fmt in ("e4m3", "e5m2"):
        quantizer = CurrentScalingQuantizer(fmt=fmt)

        def quantize(x, quantizer=quantizer):
            q = quantizer.quantize(x, rowwise=True, columnwise=True)
            return q.data, q.scale_inv, q.data_t

        want = quantize(x[1:])
        got = torch.compile(quantize, fullgraph=True)(x[1:])
        for g, w in zip(got, want):  # FP8 codes compared as bytes (NaN codes included)
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(_bits(g), _bits(w))
        got_inf = torch.compile(quantize, fullgraph=True)(x)
        want_inf = quantize(x)
        # With an inf in E4M3: the same NaN positions and codes elsewhere; Inductor may set
        # the NaN's sign bit where eager does not (0xFF vs 0x7F), so NaNs compare as NaN.
        nan = want_inf[0].float().isnan()
        assert torch.equal(got_inf[0].float().isnan(), nan) and nan.any() == (fmt == "e4m3")
        assert torch.equal(_bits(got_inf[0][~nan]), _bits(want_inf[0][~nan]))
        assert torch.equal(got_inf[1], want_inf[1])


SLOW = pytest.mark.slow  # one compile each: make test keeps the block case


@pytest.mark.parametrize(
    "quantizer, shape",
    [
        pytest.param(BlockScalingQuantizer(), (128, 256), id="block"),
        pytest.param(MXFP8Quantizer(), (64, 96), id="mxfp8", marks=SLOW),
        # Partial edge tiles: 1x128 along K; 128x128 along both dims (four regions).
        pytest.param(BlockScalingQuantizer(), (200, 300), id="block-partial-tiles", marks=SLOW),
        pytest.param(
            BlockScalingQuantizer(block_dim=2), (200, 300), id="block-2d-partial", marks=SLOW
        ),
        pytest.param(RowwiseQuantizer(), (72, 40), id="rowwise", marks=SLOW),
    ],
)
def test_compiled_block_quantize_bitwise(quantizer, shape):
    """Codes and scales of both layouts, and both layouts dequantized, in one graph (as a
    compiled training step has them), equal eager's bit for bit. Two Inductor CPU bugs
    once met here: fused dequantizations of both layouts failed to compile
    (``apply_scales`` says why), and padded partial tiles came out with wrong codes,
    silently (``quantize_tiles`` says why)."""

    def quantized(x):
        q = quantizer.quantize(x, rowwise=True, columnwise=True)
        columnwise = q.columnwise_operand()
        return (
            q.data,
            q.scale_inv,
            q.data_t,
            q.scale_inv_t,
            q.dequantize_rowwise_2d(),
            columnwise.dequantize_rowwise_2d(),
        )

    x = torch.randn(shape) * 3
    _assert_bitwise(torch.compile(quantized, fullgraph=True)(x), quantized(x))


def _assert_bitwise(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(_bits(g), _bits(w))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8 if t.element_size() == 1 else torch.int32)


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(fc.Float8BlockScaling(), marks=pytest.mark.slow),  # 21-38 s each, cold
        pytest.param(fc.MXFP8BlockScaling(), marks=pytest.mark.slow),
        pytest.param(fc.NVFP4BlockScaling(stochastic_rounding=False), marks=pytest.mark.slow),
    ],
    ids=["block", "mxfp8", "nvfp4"],
)
def test_block_scaled_recipes_compile(recipe):
    """A training step compiles with every block-scaled recipe and matches eager (NVFP4
    without stochastic rounding, so that eager is deterministic; with the Hadamard
    transform of the weight-gradient operands). The
    hidden activation [64, 256] is quantized in both layouts, R != K, and the head has
    out_features 32, one MX block: the shapes of the train-step benchmark's failure."""
    assert not getattr(recipe, "stochastic_rounding", False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32))
    model = fc.convert(model, recipe=recipe, keep_head=False)
    x = torch.randn(64, 64)
    eager = _step(model, _loss_inside, x, recipe)
    _assert_matches(_step(model, torch.compile(_loss_inside, fullgraph=True), x, recipe), eager)


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
def test_max_autotune_matches_eager():
    """``mode="max-autotune-no-cudagraphs"`` (Inductor's GEMM autotuning) compiles the
    same step as the default mode does."""
    model, x = _mlp(), torch.randn(32, 64)
    recipe = fc.Float8CurrentScaling()
    eager = _step(model, _loss_inside, x, recipe)
    compiled = torch.compile(_loss_inside, fullgraph=True, mode="max-autotune-no-cudagraphs")
    _assert_matches(_step(model, compiled, x, recipe), eager)


def test_delayed_scaling_under_compile_names_current_scaling():
    model, x = _mlp(), torch.randn(32, 64)
    compiled = torch.compile(_loss_inside, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="Float8CurrentScaling"):
        compiled(model, x, fc.DelayedScaling())


@pytest.mark.slow  # 21 s of cold compiles
def test_checkpoint_and_micro_batches_inside_a_compiled_function():
    """``torch.utils.checkpoint`` (both modes) around the model and ``is_first_microbatch``
    on its layers trace (Dynamo recomputes the region itself; the compiled graph quantizes the
    weight every call, which is what the eager cache holds): the same loss and grads."""
    from torch.utils.checkpoint import checkpoint

    model, x = _mlp(), torch.randn(32, 64)
    recipe = fc.Float8CurrentScaling()

    def checkpointed(reentrant):
        def loss(m, x, r):
            with fc.autocast(recipe=r):
                y = checkpoint(m, x, use_reentrant=reentrant)
            return y.square().mean()

        return loss

    def micro_batch(first):
        def loss(m, x, r):
            with fc.autocast(recipe=r):
                y = m[2](m[1](m[0](x, is_first_microbatch=first)), is_first_microbatch=first)
            return y.square().mean()

        return loss

    want = _step(model, _loss_inside, x, recipe)
    for reentrant in (False, True):
        compiled = torch.compile(checkpointed(reentrant), fullgraph=True)
        _assert_matches(_step(model, compiled, x, recipe), want)
    for first in (True, False):
        compiled = torch.compile(micro_batch(first), fullgraph=True)
        _assert_matches(_step(model, compiled, x, recipe), want)


def test_a_quantizer_holding_a_process_group_refuses_to_be_compiled():
    group = object()  # stands for a process group: the refusal comes before any use of it
    quantizer = CurrentScalingQuantizer(amax_reduction_group=group)
    compiled = torch.compile(lambda x: quantizer.quantize(x).data, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="amax_reduction_group.*does not run under torch.compile"):
        compiled(torch.randn(16, 16))


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
def test_compiled_model_reads_the_autocast_state_of_its_calling_context():
    """Per context, as eager: a fresh Context or a plain thread runs in high precision
    even inside another context's autocast, asyncio.to_thread and a copied context
    inherit the caller's recipe, and two interleaved asyncio tasks each get their own."""
    import asyncio  # noqa: PLC0415
    import contextvars  # noqa: PLC0415
    import threading  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    model, x = _mlp(), torch.randn(32, 64)
    r1, r2 = fc.Float8CurrentScaling(), fc.Float8RowwiseScaling()

    def eager(recipe):
        with fc.autocast(enabled=recipe is not None, recipe=recipe or r1):
            return model(x)

    want = {None: eager(None), r1: eager(r1), r2: eager(r2)}
    assert not torch.equal(want[None], want[r1]) and not torch.equal(want[r1], want[r2])
    compiled = torch.compile(model, fullgraph=True)

    def close(got, recipe):
        return torch.allclose(got, want[recipe], rtol=1e-5, atol=1e-6)

    with warnings.catch_warnings():  # the layers' runs reach the eager autocast's check
        warnings.simplefilter(
            "error", importlib.import_module("fastcast.autocast").UnusedAutocastWarning
        )
        with fc.autocast(recipe=r1):
            assert close(compiled(x), r1)
            assert close(contextvars.Context().run(compiled, x), None)
            assert close(contextvars.copy_context().run(compiled, x), r1)
            assert close(asyncio.run(asyncio.to_thread(compiled, x)), r1)
            seen = {}
            t = threading.Thread(target=lambda: seen.setdefault("out", compiled(x)))
            t.start()
            t.join(60)
            assert close(seen["out"], None)
    assert close(compiled(x), None)

    async def task(recipe, entered, ran):
        if recipe is None:  # runs while the other task is suspended inside its autocast
            await entered.wait()
            out = compiled(x)
            ran.set()
            return close(out, None)
        with fc.autocast(recipe=recipe):
            entered.set()
            await ran.wait()
            return close(compiled(x), recipe)

    async def main():
        entered, ran = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task(r2, entered, ran), task(None, entered, ran))

    assert asyncio.run(main()) == [True, True]
