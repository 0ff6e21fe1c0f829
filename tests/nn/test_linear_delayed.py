"""fc.Linear under DelayedScaling: when scales move, what they are, calibration,
activation recomputation, and the delayed-scaling state in checkpoints and copies.

Tests that follow scales through steps run in a fresh ``contextvars.Context`` (an
autocast stack of their own). The delayed-scaling slabs are per thread, so modules of
other tests may share them; a slab update moves only the columns of modules that
recorded an amax in the step, so those never change what a test observes.
"""

from __future__ import annotations

import copy
import gc
import io
import math
import pickle
import re

import pytest
import torch
from _contexts import isolated
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastcast as fc
from fastcast.quantizers.tensorwise import FixedScaleQuantizer

pytestmark = pytest.mark.usefixtures("single_thread")


E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def amax(t):
    return t.detach().abs().max().double()


def expected_scale(a, fmt_max=E4M3_MAX, margin=0):
    """``fmt_max / amax / 2**margin``, in float64, as the FP32 value it rounds to."""
    return torch.tensor(fmt_max / float(a) / 2.0**margin, dtype=torch.float32)


def assert_scale(actual, expected):
    # The library may compute fmt_max * (1 / amax): allow an FP32 ulp or two.
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=3e-7, atol=0)


def fwd_scale(lin):
    return lin._scheme_state[0].scale  # columns: input, weight


def bwd_scale(lin):
    return lin._scheme_state[1].scale  # column: grad_output


def with_amax(shape, value, seed):
    """A random tensor whose max magnitude is exactly ``value``."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(shape, generator=g) * 2 - 1) * (0.99 * value)  # |t| < value
    t.view(-1)[7] = -value
    return t


# -- when and how the scales move -----------------------------------------------------------
def test_first_step_scales():
    def body():
        recipe = fc.DelayedScaling()
        torch.manual_seed(0)
        lin = fc.Linear(64, 32)
        x = with_amax((64, 64), 3.0, seed=1)
        g = with_amax((64, 32), 0.25, seed=2)
        with fc.autocast(recipe=recipe):
            y = lin(x)
            # Inside the step: amaxes recorded, scales untouched (step 1 uses 1.0).
            assert torch.equal(fwd_scale(lin), torch.ones(2))
            hist = lin._scheme_state[0].history
            assert hist[0, 0].item() == 3.0
            assert hist[0, 1].item() == lin.weight.detach().abs().max().item()
        assert_scale(fwd_scale(lin)[0], expected_scale(3.0))
        assert_scale(fwd_scale(lin)[1], expected_scale(amax(lin.weight)))
        assert torch.equal(bwd_scale(lin), torch.ones(1))  # backward has not run
        y.backward(g)
        assert_scale(bwd_scale(lin)[0], expected_scale(0.25, E5M2_MAX))

    isolated(body)


def _delayed_reference(x, weight, bias, g, s_fwd, s_bwd, fwd_fmt="e4m3", bwd_fmt="e5m2"):
    """FP64 output and gradients from operands quantized with the given per-tensor scales."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    g2d = g.reshape(-1, g.shape[-1])
    xq = FixedScaleQuantizer(s_fwd[0:1], fwd_fmt).quantize(x2d).dequantize(torch.float64)
    wq = FixedScaleQuantizer(s_fwd[1:2], fwd_fmt).quantize(weight.detach())
    wq = wq.dequantize(torch.float64)
    gq = FixedScaleQuantizer(s_bwd[0:1], bwd_fmt).quantize(g2d).dequantize(torch.float64)
    out = xq @ wq.T
    if bias is not None:
        out = out + bias.detach().double()
    # Per-tensor FP8 transposes exactly: the column-wise layouts are the transposes.
    return out.reshape(*x.shape[:-1], -1), (gq @ wq).reshape(x.shape), gq.T @ xq


@pytest.mark.parametrize("lead", [(64,), (2, 32)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fmt", [fc.Format.HYBRID, fc.Format.E4M3])
def test_step_k_uses_scales_from_steps_before_k(fmt, bias, lead):
    def body():
        recipe = fc.DelayedScaling(fp8_format=fmt)
        bwd_fmt, bwd_max = ("e5m2", E5M2_MAX) if fmt is fc.Format.HYBRID else ("e4m3", E4M3_MAX)
        torch.manual_seed(3)
        lin = fc.Linear(64, 48, bias=bias)
        x1, g1 = with_amax((*lead, 64), 5.0, 4), with_amax((*lead, 48), 1e-3, 5)
        with fc.autocast(recipe=recipe):
            y1 = lin(x1)
        y1.backward(g1)
        s_fwd, s_bwd = fwd_scale(lin).clone(), bwd_scale(lin).clone()
        assert_scale(s_fwd[0], expected_scale(5.0))
        assert_scale(s_bwd[0], expected_scale(1e-3, bwd_max))

        # Step 2, with larger tensors: quantized with step 1's scales (saturating).
        lin.zero_grad(set_to_none=True)
        x2 = with_amax((*lead, 64), 40.0, 6).requires_grad_()
        g2 = with_amax((*lead, 48), 2e-3, 7)
        with fc.autocast(recipe=recipe):
            y2 = lin(x2)
        y2.backward(g2)
        out, dx, dw = _delayed_reference(
            x2, lin.weight, lin.bias, g2, s_fwd, s_bwd, bwd_fmt=bwd_fmt
        )
        for actual, ref in ((y2, out), (x2.grad, dx), (lin.weight.grad, dw)):
            assert actual.shape == ref.shape
            err = (actual.double() - ref).abs().max()
            assert err <= 1e-5 * ref.abs().max(), err
        if bias:
            torch.testing.assert_close(lin.bias.grad.double(), g2.reshape(-1, 48).double().sum(0))
        # and then the scales follow the larger of the two steps' amaxes (window max)
        assert_scale(fwd_scale(lin)[0], expected_scale(40.0))
        assert_scale(bwd_scale(lin)[0], expected_scale(2e-3, bwd_max))

    isolated(body)


@pytest.mark.parametrize("margin", [1, 3])
def test_margin(margin):
    def body():
        lin = fc.Linear(32, 32)
        x = with_amax((32, 32), 2.5, 8)
        g = with_amax((32, 32), 0.5, 9)
        with fc.autocast(recipe=fc.DelayedScaling(margin=margin)):
            y = lin(x)
        y.backward(g)
        assert_scale(fwd_scale(lin)[0], expected_scale(2.5, margin=margin))
        assert_scale(fwd_scale(lin)[1], expected_scale(amax(lin.weight), margin=margin))
        assert_scale(bwd_scale(lin)[0], expected_scale(0.5, E5M2_MAX, margin=margin))

    isolated(body)


def _input_scales_over_steps(recipe, amaxes):
    """The input scale after each training step with inputs of the given amaxes."""
    lin = fc.Linear(32, 32)
    scales = []
    for i, a in enumerate(amaxes):
        with fc.autocast(recipe=recipe):
            y = lin(with_amax((32, 32), a, 10 + i))
        y.sum().backward()
        scales.append(fwd_scale(lin)[0].clone())
    return scales


@pytest.mark.parametrize(
    "algo, length, expected_amaxes",
    [
        ("max", 2, [10.0, 10.0, 1.0, 2.0]),  # window of two steps
        ("max", 3, [10.0, 10.0, 10.0, 2.0]),
        ("max", 1, [10.0, 1.0, 1.0, 2.0]),
        ("most_recent", 3, [10.0, 1.0, 1.0, 2.0]),
    ],
)
def test_amax_history_window(algo, length, expected_amaxes):
    recipe = fc.DelayedScaling(amax_history_len=length, amax_compute_algo=algo)
    scales = isolated(_input_scales_over_steps, recipe, [10.0, 1.0, 1.0, 2.0])
    for got, a in zip(scales, expected_amaxes):
        assert_scale(got, expected_scale(a))


def mean_of_history(history):
    """A custom amax algorithm: the mean over the whole window (zeros included)."""
    return history.mean(dim=0)


def test_callable_amax_compute_algo():
    recipe = fc.DelayedScaling(amax_history_len=4, amax_compute_algo=mean_of_history)
    scales = isolated(_input_scales_over_steps, recipe, [8.0, 4.0])
    assert_scale(scales[0], expected_scale(8.0 / 4))
    assert_scale(scales[1], expected_scale((8.0 + 4.0) / 4))


def eighth_scale(amax, scale, fmt_max, recipe):
    """A custom scaling-factor algorithm: an eighth of the usual scale."""
    return torch.where(amax > 0, fmt_max / amax / 8, scale)


def test_callable_scaling_factor_compute_algo():
    recipe = fc.DelayedScaling(scaling_factor_compute_algo=eighth_scale)
    scales = isolated(_input_scales_over_steps, recipe, [2.0])
    assert_scale(scales[0], expected_scale(2.0 * 8))


def test_inner_autocast_exit_does_not_update_only_the_outermost():
    def body():
        recipe = fc.DelayedScaling()
        lin = fc.Linear(32, 32)
        with fc.autocast(recipe=recipe):
            with fc.autocast(recipe=recipe):
                y = lin(with_amax((32, 32), 4.0, 20))
            assert torch.equal(fwd_scale(lin), torch.ones(2))  # inner exit: no update
            with fc.autocast(recipe=recipe):
                with fc.autocast(recipe=recipe):
                    y = y + lin(with_amax((32, 32), 8.0, 21))
                assert torch.equal(fwd_scale(lin), torch.ones(2))
        assert_scale(fwd_scale(lin)[0], expected_scale(8.0))  # one update, both amaxes
        y.sum().backward()
        assert_scale(bwd_scale(lin)[0], expected_scale(1.0, E5M2_MAX))

    isolated(body)


def test_enabled_autocast_inside_disabled_one_updates_on_its_exit():
    def body():
        recipe = fc.DelayedScaling()
        lin = fc.Linear(32, 32)
        with fc.autocast(enabled=False, recipe=recipe):
            with fc.autocast(recipe=recipe):
                y = lin(with_amax((32, 32), 4.0, 22))
            assert_scale(fwd_scale(lin)[0], expected_scale(4.0))  # it opened the step
            # A disabled level runs in high precision and moves nothing.
            lin(with_amax((32, 32), 100.0, 23))
        assert_scale(fwd_scale(lin)[0], expected_scale(4.0))
        y.sum().backward()
        assert_scale(bwd_scale(lin)[0], expected_scale(1.0, E5M2_MAX))

    isolated(body)


def test_forward_without_grad_records_but_does_not_update():
    def body():
        recipe = fc.DelayedScaling()
        lin = fc.Linear(32, 32)
        with torch.no_grad(), fc.autocast(recipe=recipe):
            lin(with_amax((32, 32), 50.0, 24))
        assert torch.equal(fwd_scale(lin), torch.ones(2))
        with fc.autocast(recipe=recipe):
            lin(with_amax((32, 32), 2.0, 25))
        # The no-grad amax joined the next update.
        assert_scale(fwd_scale(lin)[0], expected_scale(50.0))

    isolated(body)


@settings(max_examples=25, deadline=None)
@given(fails=st.lists(st.booleans(), min_size=1, max_size=6), history_len=st.sampled_from([1, 3]))
def test_a_failed_forward_leaves_the_amax_history_as_it_was(fails, history_len):
    """Steps that raise in the middle of the forward (after layer 0 recorded an outlier's
    amax) change nothing: every layer's history and scales are those of a run where the
    failed steps never happened (the next good step used to quantize with the failed
    step's amax)."""

    def run(with_failures):
        recipe = fc.DelayedScaling(amax_history_len=history_len)
        torch.manual_seed(0)
        model = fc.convert(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)))
        for step, fail in enumerate(fails):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            if fail and not with_failures:
                continue
            try:
                with fc.autocast(recipe=recipe):
                    h = model[0](x * 1e3 if fail else x)
                    if fail:
                        raise KeyError("a failure in the middle of the forward")
                    y = model[2](model[1](h))
            except KeyError:
                continue
            y.sum().backward()
        metas = [layer._scheme_state.get(d) for layer in (model[0], model[2]) for d in (0, 1)]
        # (A layer that never ran has no state: as a fresh one, no amax and unit scales.)
        return [
            (torch.zeros(history_len, 2 - d % 2), torch.ones(2 - d % 2))
            if meta is None
            else (meta.history.clone(), meta.scale.clone())
            for d, meta in enumerate(metas)
        ]

    for (h1, s1), (h2, s2) in zip(isolated(run, True), isolated(run, False)):
        assert torch.equal(h1, h2) and torch.equal(s1, s2)


def test_backward_scales_update_after_the_last_modules_backward():
    def body():
        recipe = fc.DelayedScaling()
        torch.manual_seed(26)
        model = fc.convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)))
        first, last = model[0], model[2]
        seen = {}

        def hook(grad):  # between the last layer's backward and the first layer's
            seen["last"] = bwd_scale(last).clone()
            seen["first"] = bwd_scale(first).clone()
            seen["last_amax"] = last._scheme_state[1].history[0, 0].clone()

        x = torch.randn(64, 64)
        with fc.autocast(recipe=recipe):
            h = model[1](first(x))
            h.register_hook(hook)
            y = last(h)
        g = with_amax((64, 32), 0.125, 27)
        y.backward(g)
        assert torch.equal(seen["last"], torch.ones(1))
        assert torch.equal(seen["first"], torch.ones(1))
        assert seen["last_amax"].item() == 0.125  # recorded, not yet applied
        assert_scale(bwd_scale(last)[0], expected_scale(0.125, E5M2_MAX))
        assert bwd_scale(first)[0].item() != 1.0  # updated by the same, final, update

    isolated(body)


def test_backward_scales_update_with_a_frozen_first_layer():
    def body():
        recipe = fc.DelayedScaling()
        torch.manual_seed(28)
        model = fc.convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)))
        model[0].requires_grad_(False)
        with fc.autocast(recipe=recipe):
            y = model(torch.randn(64, 64))
        y.backward(with_amax((64, 32), 0.125, 29))
        assert_scale(bwd_scale(model[2])[0], expected_scale(0.125, E5M2_MAX))

    isolated(body)


def test_first_run_under_inference_mode_then_training():
    def body():
        recipe = fc.DelayedScaling()
        lin = fc.Linear(32, 32)
        with torch.inference_mode(), fc.autocast(recipe=recipe):
            lin(with_amax((32, 32), 3.0, 30))
        with fc.autocast(recipe=recipe):
            y = lin(with_amax((32, 32), 2.0, 31))
        y.sum().backward()
        assert_scale(fwd_scale(lin)[0], expected_scale(3.0))

    isolated(body)


# -- calibration --------------------------------------------------------------------------------
def test_calibration_runs_high_precision_and_sets_scales():
    def body():
        recipe = fc.DelayedScaling()
        torch.manual_seed(32)
        lin = fc.Linear(64, 32)
        ref = nn.Linear(64, 32)
        ref.load_state_dict(lin.state_dict(), strict=False)
        batches = [with_amax((16, 64), a, 33 + i) for i, a in enumerate((2.0, 7.0, 3.0))]
        for x in batches:
            x_grad, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
            with fc.autocast(enabled=False, calibrating=True, recipe=recipe):
                y = lin(x_grad)
            y_ref = ref(x_ref)
            assert torch.equal(y, y_ref)
            y.sum().backward()
            y_ref.sum().backward()
            assert torch.equal(x_grad.grad, x_ref.grad)
        assert torch.equal(lin.weight.grad, ref.weight.grad)
        # Scales from the largest amax seen (history window 'max'), computed here anew.
        assert_scale(fwd_scale(lin)[0], expected_scale(7.0))
        assert_scale(fwd_scale(lin)[1], expected_scale(amax(lin.weight)))
        calibrated = fwd_scale(lin).clone()

        # The first FP8 step quantizes with the calibrated scales.
        x = with_amax((16, 64), 5.0, 40)
        with fc.autocast(recipe=recipe):
            y = lin(x)
        out, _, _ = _delayed_reference(
            x, lin.weight, lin.bias, torch.zeros(16, 32), calibrated, torch.ones(1)
        )
        assert (y.double() - out).abs().max() <= 1e-5 * out.abs().max()

    isolated(body)


def test_calibration_under_no_grad_also_updates():
    def body():
        lin = fc.Linear(32, 32)
        with (
            torch.no_grad(),
            fc.autocast(enabled=False, calibrating=True, recipe=fc.DelayedScaling()),
        ):
            lin(with_amax((32, 32), 6.0, 41))
        assert_scale(fwd_scale(lin)[0], expected_scale(6.0))

    isolated(body)


# -- activation recomputation -------------------------------------------------------------------
def _mlp(seed):
    torch.manual_seed(seed)
    return fc.convert(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)))


def _step(model, x, recipe, use_checkpoint):
    """One training step; returns output, input grad, parameter grads, forward scales
    right after the autocast exit."""
    x = x.clone().requires_grad_()
    with fc.autocast(recipe=recipe):
        if use_checkpoint:
            y = checkpoint(model, x, use_reentrant=False)
        else:
            y = model(x)
    scales = [fwd_scale(m).clone() for m in model if isinstance(m, fc.Linear) and m._scheme_state]
    y.pow(2).sum().backward()
    return y.detach(), x.grad, [p.grad for p in model.parameters()], scales


@pytest.mark.parametrize(
    "recipe", [fc.DelayedScaling(), fc.Float8CurrentScaling()], ids=["delayed", "current"]
)
def test_checkpoint_gives_bitwise_identical_gradients(recipe):
    model = _mlp(42)
    if isinstance(recipe, fc.DelayedScaling):
        # One step first, so that the scales are not the initial ones.
        isolated(_step, model, torch.randn(64, 64), recipe, False)
    stateful = model[0]._scheme_state
    before = [fwd_scale(m).clone() for m in (model[0], model[2])] if stateful else None
    x = torch.randn(64, 64) * 6  # larger than before: the scales move at autocast exit
    plain = isolated(_step, copy.deepcopy(model), x, recipe, False)
    ckpt = isolated(_step, copy.deepcopy(model), x, recipe, True)
    assert torch.equal(plain[0], ckpt[0])
    assert torch.equal(plain[1], ckpt[1])
    for a, b in zip(plain[2], ckpt[2]):
        assert torch.equal(a, b)
    if before is not None:
        # The recomputation happened after the scales moved: it must have replayed.
        for old, new in zip(before, ckpt[3]):
            assert not torch.equal(old, new)
        assert all(torch.equal(a, b) for a, b in zip(plain[3], ckpt[3]))


def test_checkpoint_with_microbatch_weight_cache_is_bitwise_identical():
    recipe = fc.DelayedScaling()
    torch.manual_seed(43)
    base = fc.Linear(64, 64)
    xs = [torch.randn(64, 64), torch.randn(64, 64) * 3]

    def run(lin, use_checkpoint):
        grads = []
        for i, x in enumerate(xs):
            x = x.clone().requires_grad_()
            fn = lambda t, first=(i == 0): lin(t, is_first_microbatch=first)
            with fc.autocast(recipe=recipe):
                if use_checkpoint:
                    y = checkpoint(fn, x, use_reentrant=False)
                else:
                    y = fn(x)
            y.pow(2).sum().backward()
            grads.append(x.grad)
        return grads, lin.weight.grad

    plain = isolated(run, copy.deepcopy(base), False)
    ckpt = isolated(run, copy.deepcopy(base), True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], ckpt[0]))
    assert torch.equal(plain[1], ckpt[1])


# -- state: state dict, torch.save, deepcopy, pickle ------------------------------------------
def _trained(seed=50, steps=2):
    """A module after a few delayed-scaling steps (run in a context of its own)."""
    torch.manual_seed(seed)
    lin = fc.Linear(64, 32)

    def body():
        for i in range(steps):
            with fc.autocast(recipe=fc.DelayedScaling(amax_history_len=16)):
                y = lin(with_amax((32, 64), 2.0 + i, seed + i))
            y.backward(with_amax((32, 32), 0.01 * (i + 1), seed + 10 + i))

    isolated(body)
    return lin


def _walk(obj, path="_extra_state"):
    """Every leaf of a nested dict/list, with its path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str), (path, k)
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, obj


def test_extra_state_holds_only_tensors_and_primitives():
    lin = _trained()
    state = lin.state_dict()["_extra_state"]
    assert state is not None
    leaves = dict(_walk(state))
    assert any(isinstance(v, torch.Tensor) for v in leaves.values())
    for path, v in leaves.items():
        assert isinstance(v, (torch.Tensor, str, int, float, bool, type(None))), (path, type(v))
        if isinstance(v, torch.Tensor):
            assert v.dtype == torch.float32, path


def _next_step_output(lin, x):
    def body():
        with fc.autocast(recipe=fc.DelayedScaling(amax_history_len=16)):
            return lin(x).detach()

    return isolated(body)


def test_state_dict_round_trip_through_torch_save_weights_only():
    lin = _trained()
    buf = io.BytesIO()
    torch.save(lin.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = fc.Linear(64, 32)
    assert fresh.load_state_dict(loaded).missing_keys == []
    for d in (0, 1):
        assert torch.equal(fresh._scheme_state[d].scale, lin._scheme_state[d].scale)
        assert torch.equal(fresh._scheme_state[d].history, lin._scheme_state[d].history)
        assert fresh._scheme_state[d].scale.data_ptr() != lin._scheme_state[d].scale.data_ptr()
    assert not torch.equal(fresh._scheme_state[0].scale, torch.ones(2))
    # The next step of either module quantizes with the same scales.
    x = with_amax((32, 64), 9.0, 60)
    assert torch.equal(_next_step_output(fresh, x), _next_step_output(lin, x))


def test_loading_state_into_a_module_that_has_run_replaces_its_scales():
    source, target = _trained(seed=61), _trained(seed=62)
    target.load_state_dict(source.state_dict())
    assert torch.equal(target._scheme_state[0].scale, source._scheme_state[0].scale)
    x = with_amax((32, 64), 1.0, 63)
    assert torch.equal(_next_step_output(target, x), _next_step_output(source, x))


def test_extra_state_none_starts_the_scales_afresh():
    """Version 1's None (a stateless module) holds no state: as an absent entry, it
    starts the scales of a layer that keeps them afresh, and says so."""
    lin = _trained()
    sd = lin.state_dict()
    sd["_extra_state"] = None
    with pytest.warns(UserWarning, match="start afresh"):
        lin.load_state_dict(sd)
    view = fc.read_extra_state(lin.get_extra_state())
    assert view["kind"] == "delayed_scaling"
    assert torch.equal(view["forward"]["scale"], torch.ones(2))
    assert not view["forward"]["amax_history"].any()


class _Tripwire:
    """Unpickling this calls ``_trip``: a pickle payload must never be executed."""

    def __reduce__(self):
        return (_trip, ())


TRIPPED = []


def _trip():
    TRIPPED.append(True)
    return None


@pytest.mark.parametrize("form", ["bytes", "bytesio", "uint8-tensor"])
def test_pickled_extra_state_is_refused_without_unpickling(form):
    payload = pickle.dumps({"scale": _Tripwire()})
    if form == "bytesio":
        payload = io.BytesIO(payload)
    elif form == "uint8-tensor":
        payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    lin = fc.Linear(64, 32)
    sd = lin.state_dict()
    sd["_extra_state"] = payload
    with pytest.raises(ValueError, match="pickle") as info:
        lin.load_state_dict(sd)
    assert "_trip" in str(info.value)  # it says what the payload would have imported
    assert TRIPPED == []


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_have_equal_but_independent_scales(how):
    lin = _trained()
    if how == "deepcopy":
        other = copy.deepcopy(lin)
    elif how == "pickle":
        other = pickle.loads(pickle.dumps(lin))
    else:
        buf = io.BytesIO()
        torch.save(lin, buf)
        buf.seek(0)
        other = torch.load(buf, weights_only=False)
    assert torch.equal(other.weight, lin.weight)
    for d in (0, 1):
        assert torch.equal(other._scheme_state[d].scale, lin._scheme_state[d].scale)
        assert torch.equal(other._scheme_state[d].history, lin._scheme_state[d].history)
    original = lin._scheme_state[0].scale.clone()
    other._scheme_state[0].scale.mul_(2)  # changing the copy's scales ...
    assert torch.equal(lin._scheme_state[0].scale, original)  # ... leaves the original's alone
    # Running the copy (and updating its scales) leaves the original alone too.
    x = with_amax((32, 64), 30.0, 70)
    _next_step_output(other, x)
    assert torch.equal(lin._scheme_state[0].scale, original)
    # and both still run
    assert _next_step_output(lin, x).shape == (32, 32)


def test_module_that_ran_delayed_scaling_in_this_thread_copies_and_keeps_running():
    """Copies of a module that is a member of this thread's registry."""

    def body():
        recipe = fc.DelayedScaling()
        lin = fc.Linear(32, 32)
        with fc.autocast(recipe=recipe):
            lin(with_amax((32, 32), 2.0, 71)).sum().backward()
        twin = copy.deepcopy(lin)
        assert torch.equal(twin._scheme_state[0].scale, lin._scheme_state[0].scale)
        with fc.autocast(recipe=recipe):
            twin(with_amax((32, 32), 16.0, 72)).sum().backward()
        assert_scale(fwd_scale(twin)[0], expected_scale(16.0))
        assert_scale(fwd_scale(lin)[0], expected_scale(2.0))  # not the twin's amax

    isolated(body)


def test_discarded_modules_leave_the_registry():
    def body():
        recipe = fc.DelayedScaling()
        keep = fc.Linear(32, 32)
        with fc.autocast(recipe=recipe):
            keep(torch.randn(32, 32))
        slab = keep._scheme_state[0].slab
        members = len(slab.members)
        for _ in range(3):
            tmp = fc.Linear(32, 32)
            with fc.autocast(recipe=recipe):
                tmp(torch.randn(32, 32))
        del tmp
        gc.collect()
        # Dead modules' columns are compacted away by the next update of the slab.
        with fc.autocast(recipe=recipe):
            keep(torch.randn(32, 32))
        assert len(slab.members) == members
        assert slab.scale.numel() == 2 * members  # input and weight columns of `keep`

    isolated(body)


def test_scales_stay_fp32_when_parameters_change_dtype():
    lin = _trained()
    scale = lin._scheme_state[0].scale.clone()
    lin.to(torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16
    assert lin._scheme_state[0].scale.dtype == torch.float32
    assert torch.equal(lin._scheme_state[0].scale, scale)
    assert math.isfinite(lin._scheme_state[1].scale.item())


def test_backward_watch_hooks_a_weight_once_and_forgets_it_when_it_dies(monkeypatch):
    """The gradient hook compiled delayed scaling relies on (watch_backward): one per
    live weight whatever the number of calls, and nothing kept for dead weights."""
    import threading  # noqa: PLC0415

    from fastcast.schemes.delayed import DelayedState  # noqa: PLC0415

    state = DelayedState(threading.current_thread())
    ends: list[int] = []
    # Count the step ends the hooks queue.
    monkeypatch.setattr(DelayedState, "_backward_finished", lambda self: ends.append(1))
    weight = torch.ones(3, requires_grad=True)
    for _ in range(3):
        state.watch_backward(weight)
    (weight * 2).sum().backward()
    assert ends == [1]  # one hook, one end of step for the pass
    assert len(state.watched) == 1
    del weight
    gc.collect()
    assert len(state.watched) == 0


# -- concurrency: asyncio tasks and threads ----------------------------------------------------
# The property: concurrent use of DelayedScaling modules leaves every module's amax
# histories and scales (its extra state) exactly as running the same steps one after
# another would, or is refused with a clear error before the refused caller changed
# anything.
REFUSED = "in use by (asyncio task|thread)"


def _step_inputs(worker, step):
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(4, 8, generator=g) * (1 + step), torch.randn(4, 8, generator=g) * 0.5


def _sequential(model, recipe, runs):
    """``runs`` (``(worker, steps)``) one after another on ``model``, no concurrency."""

    def body():
        for worker, steps in runs:
            for step in range(steps):
                a, b = _step_inputs(worker, step)
                with fc.autocast(recipe=recipe):
                    y = model(a) + model(b)
                y.pow(2).sum().backward()

    isolated(body)
    return model


def _same_state(actual, expected):
    return torch.equal(actual.get_extra_state(), expected.get_extra_state())


async def _task_steps(model, recipe, worker, steps, pauses, claimed):
    """One task's steps; the layer runs twice per step, across awaits (``pauses``: how
    many times to yield at each await point, chosen by the test)."""
    import asyncio  # noqa: PLC0415

    pause = iter(pauses)
    for step in range(steps):
        a, b = _step_inputs(worker, step)
        with fc.autocast(recipe=recipe):
            y = model(a)
            if step == 0:
                claimed.append(worker)
            for _ in range(next(pause, 0)):
                await asyncio.sleep(0)
            y = y + model(b)
        for _ in range(next(pause, 0)):
            await asyncio.sleep(0)
        y.pow(2).sum().backward()
        for _ in range(next(pause, 0)):
            await asyncio.sleep(0)


@settings(max_examples=30, deadline=None)
@given(
    history_len=st.integers(1, 4),
    steps=st.lists(st.integers(1, 3), min_size=2, max_size=3),
    pauses=st.lists(st.integers(0, 2), min_size=9, max_size=9),
    shared=st.booleans(),
)
def test_asyncio_tasks_equal_sequential_steps_or_are_refused(history_len, steps, pauses, shared):
    import asyncio  # noqa: PLC0415

    recipe = fc.DelayedScaling(amax_history_len=history_len)
    torch.manual_seed(0)
    base = fc.Linear(8, 8)
    initial = copy.deepcopy(base)
    models = [base] if shared else [copy.deepcopy(base) for _ in steps]
    claimed, outcomes = [], []

    async def main():
        tasks = [
            asyncio.create_task(
                _task_steps(models[0 if shared else w], recipe, w, n, pauses[w::3], claimed)
            )
            for w, n in enumerate(steps)
        ]
        outcomes.extend(await asyncio.gather(*tasks, return_exceptions=True))

    isolated(asyncio.run, main())
    for outcome in outcomes:
        if outcome is not None:
            assert shared and isinstance(outcome, RuntimeError), outcome
            assert re.search(REFUSED, str(outcome))
    done = [w for w, outcome in enumerate(outcomes) if outcome is None]
    assert done  # the first task to run a module always may
    if shared:
        # Refused at its first call (it ran nothing); the others ran one after another,
        # in the order they claimed the module.
        assert [w for w in claimed if w in done] == claimed
        expected = _sequential(initial, recipe, [(w, steps[w]) for w in claimed])
        assert _same_state(base, expected)
    else:
        for w, n in enumerate(steps):
            assert _same_state(models[w], _sequential(copy.deepcopy(initial), recipe, [(w, n)]))


@settings(max_examples=8, deadline=None)
@given(threads=st.integers(2, 3), steps=st.integers(1, 3))
def test_threads_starting_on_a_fresh_module_at_once_one_runs_others_are_refused(threads, steps):
    """The claim is atomic: threads that first use a fresh module at the same moment
    never both run it; the ones that ran did so one after another."""
    import threading  # noqa: PLC0415

    recipe = fc.DelayedScaling(amax_history_len=3)
    torch.manual_seed(0)
    base = fc.Linear(8, 8)
    initial = copy.deepcopy(base)
    barrier = threading.Barrier(threads, timeout=30)
    lock = threading.Lock()
    claimed, outcomes = [], {}

    def worker(w):
        def body():
            barrier.wait()
            for step in range(steps):
                a, b = _step_inputs(w, step)
                with fc.autocast(recipe=recipe):
                    y = base(a)
                    if step == 0:
                        with lock:
                            claimed.append(w)
                    y = y + base(b)
                y.pow(2).sum().backward()

        try:
            isolated(body)
            outcomes[w] = None
        except RuntimeError as exc:
            outcomes[w] = exc

    pool = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert len(outcomes) == threads
    for outcome in outcomes.values():
        assert outcome is None or re.search(REFUSED, str(outcome)), outcome
    done = sorted(w for w, outcome in outcomes.items() if outcome is None)
    assert done and sorted(claimed) == done
    expected = _sequential(initial, recipe, [(w, steps) for w in claimed])
    assert _same_state(base, expected)
