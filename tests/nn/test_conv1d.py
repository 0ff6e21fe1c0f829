"""fc.Conv1D: transformers' Conv1D ([in, out] weight) with fc.Linear's quantized GEMMs."""

from __future__ import annotations

import copy
import io
import logging
import warnings

import pytest
import torch
from torch import nn

import fastcast as fc

transformers_utils = pytest.importorskip("transformers.pytorch_utils")
HFConv1D = transformers_utils.Conv1D

pytestmark = pytest.mark.usefixtures("single_thread")

RECIPES = {
    "delayed": fc.DelayedScaling(),
    "current": fc.Float8CurrentScaling(),
    "block": fc.Float8BlockScaling(),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(),
    "rowwise": fc.Float8RowwiseScaling(),
    "rowwise-gw-hp": fc.Float8RowwiseScaling(wgrad_high_precision=True),
}


def _pair(nx: int = 64, nf: int = 96, seed: int = 0) -> tuple[fc.Conv1D, fc.Linear]:
    """A converted Hugging Face Conv1D and an fc.Linear holding its weight transposed."""
    torch.manual_seed(seed)
    hf = HFConv1D(nf, nx)
    with torch.no_grad():
        hf.bias.normal_()
    conv = fc.convert(hf)
    assert conv is hf and type(conv) is fc.Conv1D
    lin = fc.Linear(nx, nf)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    return conv, lin


def _step(module, x, recipe, seed, first=None):
    """Output and the gradients of input, weight (as [out, in]) and bias, under ``recipe``."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)  # NVFP4's stochastic rounding draws from the global generator
    with fc.autocast(recipe=recipe):
        out = module(x, is_first_microbatch=first)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    weight_grad = module.weight.grad
    if isinstance(module, fc.Conv1D):
        weight_grad = weight_grad.t()
    return out, x.grad, weight_grad, module.bias.grad


@pytest.mark.parametrize("name", list(RECIPES))
def test_conv1d_equals_the_linear_path_on_the_transposed_weight(name):
    recipe = RECIPES[name]
    conv, lin = _pair()
    # 40 tokens: MXFP8 and NVFP4 pad them to their blocks.
    x = torch.randn(2, 20, 64)
    for step in range(2):  # delayed scaling: the second step uses the first's scales
        got = _step(conv, x, recipe, seed=step)
        want = _step(lin, x, recipe, seed=step)
        for what, a, b in zip(("out", "dgrad", "wgrad", "bgrad"), got, want):
            assert torch.equal(a, b), (name, step, what)
        conv.zero_grad(), lin.zero_grad()
    assert conv.weight.shape == (64, 96)  # the layout stays [in, out]


def test_conv1d_outside_autocast_computes_what_transformers_conv1d_computes():
    torch.manual_seed(3)
    hf = HFConv1D(48, 32)
    with torch.no_grad():
        hf.bias.normal_()
    ref = copy.deepcopy(hf)
    fc.convert(hf)
    x = torch.randn(3, 5, 32)
    x_ref = x.clone().requires_grad_()
    x = x.requires_grad_()
    out, out_ref = hf(x), ref(x_ref)
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hf.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)


def test_conv1d_weight_cache_reuses_and_drops_the_quantized_weight():
    recipe = fc.Float8CurrentScaling()
    conv, lin = _pair()
    x = torch.randn(16, 64)
    opt = torch.optim.SGD([conv.weight, conv.bias], lr=0.5)
    opt_lin = torch.optim.SGD([lin.weight, lin.bias], lr=0.5)
    for first in (True, False, False):
        got = _step(conv, x, recipe, seed=0, first=first)
        want = _step(lin, x, recipe, seed=0, first=first)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        if first is False:  # the step must drop the kept weight of both
            opt.step(), opt_lin.step()
        conv.zero_grad(), lin.zero_grad()
    assert torch.equal(conv.weight.t(), lin.weight)
    # The kept weight is the one quantized from [in, out] storage: a cached call after
    # a write through autograd-visible ops sees the new weight.
    with torch.no_grad():
        conv.weight.mul_(2)
        lin.weight.mul_(2)
    got = _step(conv, x, recipe, seed=0, first=False)
    want = _step(lin, x, recipe, seed=0, first=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_conv1d_keeps_transformers_keys_layout_and_loads_plain_checkpoints():
    torch.manual_seed(4)
    plain = HFConv1D(32, 16)
    sd = copy.deepcopy(plain.state_dict())
    built = fc.Conv1D(32, 16)
    assert built.weight.shape == (16, 32) and built.bias.shape == (32,)
    assert {k: (v.shape, v.dtype) for k, v in built.state_dict().items()} == {
        k: (v.shape, v.dtype) for k, v in plain.state_dict().items()
    }
    assert built.load_state_dict(sd).missing_keys == []  # strict: a plain checkpoint loads
    assert torch.equal(built.weight, plain.weight)
    # ... and a converted one loads into the plain layer once its extra state is stripped.
    plain2 = HFConv1D(32, 16)
    plain2.load_state_dict(fc.strip_extra_state(built.state_dict()))
    assert torch.equal(plain2.weight, plain.weight)
    assert repr(built) == "fastcast.Conv1D(nf=32, nx=16)"
    assert (built.in_features, built.out_features) == (16, 32)


def test_conv1d_pickles_and_deep_copies():
    conv, _ = _pair(32, 48)
    with fc.autocast(recipe=fc.DelayedScaling()):
        conv(torch.randn(16, 32)).sum().backward()
    buf = io.BytesIO()
    torch.save(conv, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (loaded, copy.deepcopy(conv)):
        assert type(other) is fc.Conv1D
        assert torch.equal(other.weight, conv.weight)
        assert torch.equal(other.get_extra_state(), conv.get_extra_state())


def test_conv1d_errors_name_the_layer():
    model = nn.Sequential(HFConv1D(32, 16))
    fc.convert(model)
    with fc.autocast(recipe=fc.Float8CurrentScaling()), pytest.raises(ValueError) as info:
        model(torch.randn(4, 20))
    assert str(info.value).startswith("fc.Conv1D '0' (nf=32, nx=16): expects input [..., 16]")


def test_convert_names_conv1d_layers_and_keeps_odd_ones(caplog):
    caplog.set_level(logging.DEBUG, logger="fastcast")
    model = nn.ModuleDict({"a": HFConv1D(32, 16), "odd": HFConv1D(24, 16), "b": nn.Linear(16, 16)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one converted per one kept: no warning
        fc.convert(model)
    assert type(model["a"]) is fc.Conv1D and type(model["odd"]) is HFConv1D
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [
        "fastcast.convert: converted 1 nn.Linear layer(s) to fastcast.Linear and 1 Conv1D "
        "layer(s) to fastcast.Conv1D; skipped 1: odd (out_features=24 not a multiple of 16)"
    ]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert "fastcast.convert: a (Conv1D, in_features=16, out_features=32): converted" in debug
