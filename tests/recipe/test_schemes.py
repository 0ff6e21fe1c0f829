"""Schemes: every recipe type has one, and a new recipe needs only a recipe class, a
scheme and a quantizer (here a toy static-scale recipe, defined in this file alone)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fp8_reference import decode_fp8, encode_fp8
from torch import nn

import fastcast as fc
from fastcast.quantizers.tensorwise import quantize_with_scale
from fastcast.schemes import Scheme, recipe_support, register_scheme, scheme_for
from fastcast.tensor import TENSORWISE

# -- a toy recipe: the three pieces, and nothing else edited ---------------------------------


@dataclasses.dataclass(frozen=True, slots=True, repr=False, eq=False)
class StaticScaling(fc.Recipe):
    """Per-tensor FP8 with one fixed power-of-two scale ``2**scale_exp`` for every tensor."""

    scale_exp: int = 0

    def _check(self) -> None:
        if not isinstance(self.scale_exp, int) or isinstance(self.scale_exp, bool):
            raise ValueError(f"StaticScaling: scale_exp must be an int, got {self.scale_exp!r}")


@dataclasses.dataclass(frozen=True)
class StaticQuantizer:
    fmt: str
    scale_exp: int

    def quantize(self, x, *, rowwise=True, columnwise=False):
        scale = torch.tensor(2.0**self.scale_exp, device=x.device)
        return quantize_with_scale(x, scale, self.fmt, rowwise, columnwise)


@register_scheme(StaticScaling)
class StaticScheme(Scheme):
    family = TENSORWISE

    def alignment(self, recipe):
        return 8

    def quantizer(self, recipe, role, group=None):
        fmt = "e5m2" if role == "grad_output" else "e4m3"
        return StaticQuantizer(fmt, recipe.scale_exp)


def _q64(t: torch.Tensor, fmt: str, exp: int) -> torch.Tensor:
    """Independent float64 quantize-dequantize with scale 2**exp."""
    scale = 2.0**exp
    return decode_fp8(encode_fp8(t.double() * scale, fmt), fmt) / scale


# ---------------------------------------------------------------------------------------------


def test_every_builtin_recipe_has_its_scheme():
    recipes = [
        fc.DelayedScaling(),
        fc.Float8CurrentScaling(),
        fc.Float8BlockScaling(),
        fc.MXFP8BlockScaling(),
        fc.NVFP4BlockScaling(),
        fc.Float8RowwiseScaling(),
        fc.CustomRecipe(lambda role: None),
    ]
    schemes = [scheme_for(r) for r in recipes]
    assert len({type(s) for s in schemes}) == len(recipes)
    assert [s.alignment(r) for s, r in zip(schemes, recipes)] == [16, 16, 16, 32, 16, 16, 16]
    # Token counts: only the column-wise MX and NVFP4 blocks run along them.
    assert [s.row_alignment(r) for s, r in zip(schemes, recipes)] == [1, 1, 1, 32, 16, 1, 1]
    # Only rowwise_with_gw_hp's weight gradient takes unquantized operands.
    hp = fc.Float8RowwiseScaling(wgrad_high_precision=True)
    assert [s.wgrad_high_precision(r) for s, r in zip(schemes, recipes)] == [False] * 7
    assert scheme_for(hp).wgrad_high_precision(hp) is True


@pytest.mark.parametrize(
    "recipe, rows",
    [
        (fc.Float8CurrentScaling(), 1),
        (fc.MXFP8BlockScaling(), 32),
        (fc.NVFP4BlockScaling(), 16),
        (fc.Float8RowwiseScaling(wgrad_high_precision=True), 1),
    ],
)
def test_plan_carries_the_row_alignment_of_its_scheme(recipe, rows):
    lin = fc.Linear(64, 32)
    with fc.autocast(recipe=recipe):
        lin(torch.randn(32, 64))
    assert lin._plan.row_alignment == rows
    assert lin._plan.wgrad_high_precision is getattr(recipe, "wgrad_high_precision", False)
    assert StaticScheme().row_alignment(StaticScaling()) == 1  # the default


def test_toy_recipe_trains_through_linear_like_a_builtin_one():
    recipe = StaticScaling(scale_exp=3)
    torch.manual_seed(0)
    lin = fc.Linear(24, 8, bias=False)
    x = torch.randn(5, 24, requires_grad=True)
    with fc.autocast(recipe=recipe):
        y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    xq, wq, gq = (
        _q64(x.detach(), "e4m3", 3),
        _q64(lin.weight.detach(), "e4m3", 3),
        _q64(g, "e5m2", 3),
    )
    torch.testing.assert_close(y.double(), xq @ wq.T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), gq @ wq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lin.weight.grad.double(), gq.T @ xq, rtol=1e-6, atol=1e-6)
    # The scale really is the recipe's: another exponent gives other numbers.
    with torch.no_grad(), fc.autocast(recipe=StaticScaling(scale_exp=-4)):
        assert not torch.equal(lin(x), y)


def test_toy_recipe_through_quantize_convert_and_support():
    recipe = StaticScaling(scale_exp=2)
    x = torch.randn(4, 16)
    torch.testing.assert_close(
        fc.quantize(x, recipe).dequantize().double(), _q64(x, "e4m3", 2), rtol=0, atol=0
    )
    model = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 20))
    fc.convert(model, recipe=recipe)  # the scheme's alignment (8) decides
    assert isinstance(model[0], fc.Linear) and not isinstance(model[1], fc.Linear)
    assert recipe_support(recipe)[0]
    with pytest.raises(ValueError, match="scale_exp"):
        StaticScaling(scale_exp=1.5)


def test_a_recipe_without_a_scheme_is_a_clear_error():
    @dataclasses.dataclass(frozen=True, slots=True, repr=False, eq=False)
    class Unregistered(fc.Recipe):
        x: int = 1

    with pytest.raises(TypeError, match="no scheme is registered for Unregistered"):
        scheme_for(Unregistered())
    with pytest.raises(TypeError, match="no scheme is registered"):
        with fc.autocast(recipe=Unregistered()):
            pass
    with pytest.raises(TypeError, match="fastcast recipe"):
        scheme_for("delayed")


def test_a_recipe_type_has_one_scheme():
    with pytest.raises(ValueError, match="already has the scheme StaticScheme"):

        @register_scheme(StaticScaling)
        class Another(Scheme):
            pass

    with pytest.raises(TypeError, match="Recipe subclass"):
        register_scheme(int)(StaticScheme)
    assert type(scheme_for(StaticScaling())) is StaticScheme
