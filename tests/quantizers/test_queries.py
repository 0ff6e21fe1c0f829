"""What quantizers and schemes tell their consumers (``quantizers/base.py``,
``schemes/base.py``): the block geometry is the one the quantized tensors carry, a
quantizer ``over_shards`` gives each shard the codes and scales of the whole tensor,
and a ``CustomRecipe``'s quantizers that say nothing get the defaults."""

from __future__ import annotations

import pytest
import torch

import fastcast as fc
from fastcast.distributed.fsdp import check_recipe, gather_kind
from fastcast.quantizers import CurrentScalingQuantizer
from fastcast.quantizers.base import (
    PER_TENSOR_BLOCKS,
    is_pure,
    over_shards,
    scale_blocks,
    shard_amax,
    shard_multiple,
)
from fastcast.runtime.state import AutocastFrame
from fastcast.schemes import scheme_for

STATELESS = {
    "current": fc.Float8CurrentScaling(),
    "rowwise": fc.Float8RowwiseScaling(),
    "rowwise_gw_hp": fc.Float8RowwiseScaling(wgrad_high_precision=True),
    "block": fc.Float8BlockScaling(),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(stochastic_rounding=False),
}
ROLES = ("input", "weight", "grad_output")


@pytest.mark.parametrize("name", list(STATELESS))
@pytest.mark.parametrize("role", ROLES)
def test_scale_blocks_are_the_blocks_the_tensor_carries(name, role):
    recipe = STATELESS[name]
    scheme = scheme_for(recipe)
    q = scheme.quantizer(recipe, role)
    t = q.quantize(torch.randn(64, 128), rowwise=True, columnwise=True)
    assert scheme.scale_blocks(recipe, role) == q.scale_blocks == (t.block, t.block_t)


def test_transposable_layouts_are_the_square_tiles():
    from fastcast.distributed.fsdp import blocks  # noqa: PLC0415

    recipes = {
        **STATELESS,
        "block_1x128": fc.Float8BlockScaling(w_block_scaling_dim=1),
        "nvfp4_1x16": fc.NVFP4BlockScaling(weight_2d_blocks=False),
    }
    got = {n: blocks.transposable(blocks.weight_quantizer(r)) for n, r in recipes.items()}
    assert {n for n, t in got.items() if t} == {"current", "block", "nvfp4"}


def test_delayed_scaling_says_one_scale_per_tensor():
    recipe = fc.DelayedScaling()
    scheme = scheme_for(recipe)
    assert scheme.stateful and scheme.weight_format(recipe) == "e4m3"
    assert all(scheme.scale_blocks(recipe, role) == PER_TENSOR_BLOCKS for role in ROLES)
    assert gather_kind(recipe) == "tensor"


def test_shard_multiples_are_the_blocks_along_the_dim():
    got = {
        name: [
            shard_multiple(scale_blocks(scheme_for(r).quantizer(r, "weight")), d) for d in (0, 1)
        ]
        for name, r in STATELESS.items()
    }
    # Per tensor and per row: no block along either dim (scales spanning it are reduced).
    assert got["current"] == got["rowwise"] == [1, 1]
    assert got["block"] == [128, 128] and got["mxfp8"] == [32, 32] and got["nvfp4"] == [16, 16]


def _halves_reduced(q, x, dim):
    """Each half of ``x`` (split along ``dim`` of its matrix) quantized ``over_shards`` a
    reducer that max-reduces each amax with the other half's (two ranks, simulated: the
    other half's amaxes recorded first, in call order)."""
    halves = x.chunk(2, dim=dim)
    seen = []
    for half in halves:
        amaxes = []
        over_shards(q, lambda a, amaxes=amaxes: amaxes.append(a.clone()) or a, dim).quantize(
            half, rowwise=True, columnwise=True
        )
        seen.append(amaxes)
        got = shard_amax(q, half, dim)
        if got is not None:  # what a caller reduces up front: the one amax it hands over
            assert len(amaxes) >= 1 and all(torch.equal(got, a) for a in amaxes)
    out = []
    for mine, theirs in ((halves[0], seen[1]), (halves[1], seen[0])):
        calls = iter(theirs)
        reduce = lambda a, calls=calls: a.copy_(torch.maximum(a, next(calls)))  # noqa: E731
        out.append(over_shards(q, reduce, dim).quantize(mine, rowwise=True, columnwise=True))
    return out


@pytest.mark.parametrize("name", ["current", "rowwise", "rowwise_gw_hp", "nvfp4"])
@pytest.mark.parametrize("dim", [0, 1])
def test_over_shards_gives_each_shard_the_whole_tensors_codes(name, dim):
    """The scales spanning the split come from the whole tensor's amaxes: each shard's
    dequantized layouts are the matching part of the whole tensor's."""
    recipe = STATELESS[name]
    q = scheme_for(recipe).quantizer(recipe, "weight")
    torch.manual_seed(0)
    x = torch.randn(64, 128) * torch.logspace(-2, 2, 128)  # columns of different ranges
    whole = q.quantize(x, rowwise=True, columnwise=True)
    parts = _halves_reduced(q, x, dim)
    want = whole.dequantize().chunk(2, dim=dim)
    for part, expected in zip(parts, want):
        assert torch.equal(part.dequantize(), expected)


def test_block_scaled_quantizers_are_their_own_shards():
    for name in ("block", "mxfp8"):
        q = scheme_for(STATELESS[name]).quantizer(STATELESS[name], "input")
        assert over_shards(q, None, 0) is q and shard_amax(q, torch.ones(4, 32), 0) is None
        assert is_pure(q)


class _Plain:
    """A user's quantizer that says nothing beyond ``fmt`` and ``quantize``."""

    fmt = "e4m3"

    def quantize(self, x, *, rowwise=True, columnwise=False):
        return CurrentScalingQuantizer().quantize(x, rowwise=rowwise, columnwise=columnwise)


def test_a_custom_recipe_gets_the_defaults():
    plain = _Plain()
    recipe = fc.CustomRecipe(qfactory=lambda role: plain)
    scheme = scheme_for(recipe)
    assert scheme.scale_blocks(recipe, "input") is None and not scheme.stateful
    assert over_shards(plain, None, 0) is plain and not is_pure(plain)
    assert shard_amax(plain, torch.ones(2, 2), 0) is None
    # Tensor parallelism: its quantizers see their shards as they are.
    plan = scheme.sharded_plan(
        AutocastFrame(True, recipe), {}, torch.device("cpu"), {"weight": 0}, None
    )
    assert (plan.input_q, plan.weight_q, plan.grad_q) == (plain, plain, plain)
    # The FSDP2 gather cannot be quantized without the geometry: a clear refusal.
    assert gather_kind(recipe) is None
    with pytest.raises(NotImplementedError, match="quantized_all_gather.*CustomRecipe"):
        check_recipe(recipe)
    # ... and a factory that makes no quantizer for a role is refused the same way.
    assert gather_kind(fc.CustomRecipe(qfactory=lambda role: None)) is None


def test_a_custom_recipe_of_built_in_quantizers_gets_their_answers():
    recipe = fc.CustomRecipe(qfactory=lambda role: CurrentScalingQuantizer())
    assert scheme_for(recipe).scale_blocks(recipe, "weight") == PER_TENSOR_BLOCKS
    assert gather_kind(recipe) == "tensor"
