"""``fc.convert(..., quantized_all_gather=True)`` in one process, without FSDP2: the
wrapped weight behaves as the plain one (the two-rank FSDP2 tests are in
``test_distributed.py``, section ``fsdp_fp8``)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastcast as fc
from fastcast.distributed.fsdp import FSDPFloat8Weight, GatheredFloat8Weight

RECIPES = {
    "current": fc.Float8CurrentScaling,
    "delayed": lambda: fc.DelayedScaling(amax_history_len=4),
}


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))


def train(model: nn.Module, recipe: fc.Recipe, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        with fc.autocast(recipe=recipe):
            loss = model(x).square().mean()
        loss.backward()
        out += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", RECIPES)
def test_wrapped_weight_trains_like_the_plain_one(name):
    recipe = RECIPES[name]()
    plain = fc.convert(mlp(), recipe=recipe)
    wrapped = fc.convert(mlp(), recipe=recipe, quantized_all_gather=True)
    weight = wrapped[0].weight
    assert isinstance(weight, FSDPFloat8Weight) and isinstance(weight, nn.Parameter)
    assert weight.is_leaf and weight.requires_grad and weight.dtype == torch.float32
    for a, b in zip(train(plain, recipe), train(wrapped, recipe)):
        assert torch.equal(a, b)
    assert isinstance(wrapped[0].weight, FSDPFloat8Weight)  # the optimizer kept it


def test_state_dict_holds_plain_tensors():
    model = fc.convert(mlp(), recipe=fc.Float8CurrentScaling(), quantized_all_gather=True)
    sd = model.state_dict()
    assert type(sd["0.weight"]) is torch.Tensor
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # no class of fastcast's in the file
    target = mlp(seed=1)
    target.load_state_dict({k: v for k, v in loaded.items() if "extra" not in k})
    assert torch.equal(target[0].weight, model[0].weight._tensor)
    # Loading into the wrapped model writes into the wrapped tensor.
    model.load_state_dict(fc.convert(mlp(seed=2)).state_dict())
    assert isinstance(model[0].weight, FSDPFloat8Weight)
    assert torch.equal(model[0].weight._tensor, mlp(seed=2)[0].weight)
    assert torch.equal(copy.deepcopy(model)[0].weight._tensor, model[0].weight._tensor)


def test_refusals_leave_the_model_as_it_was():
    model = mlp()
    with pytest.raises(NotImplementedError, match="quantized_all_gather.*Float8BlockScaling"):
        fc.convert(model, recipe=fc.Float8BlockScaling(), quantized_all_gather=True)
    with pytest.raises(ValueError, match="quantized_all_gather=True needs recipe"):
        fc.convert(model, quantized_all_gather=True)
    assert type(model[0]) is nn.Linear and type(model[0].weight) is nn.Parameter


def test_gathered_weight_computes_with_its_dequantized_value():
    # The gathered weight outside the GEMMs it was cast for: codes * scale_inv, checked
    # against float64 from torch's own E4M3 cast (FP32 GEMM: rounding tolerance).
    w = torch.randn(32, 64)
    scale = 448.0 / w.abs().max()
    codes = (w * scale).to(torch.float8_e4m3fn)
    gathered = GatheredFloat8Weight(
        codes.view(torch.uint8), scale.reciprocal(), None, "e4m3", w.dtype
    )
    x = torch.randn(8, 64)
    expected = x.double() @ (codes.double() / scale.double()).T
    torch.testing.assert_close(F.linear(x, gathered).double(), expected, rtol=1e-5, atol=1e-5)
    # No quantizer: no GEMM takes it as its operand.
    assert gathered.fc_quantized(None, True) is None
