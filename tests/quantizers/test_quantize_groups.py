"""``quantize_groups``: each group of rows quantized as a tensor of its own. The built-in
quantizers do it on the device (no group size read back); the result must be, bit for
bit, what one ``quantize`` per group gives (the default any other quantizer gets), and a
quantizer without the capability runs the grouped GEMM through that default."""

from __future__ import annotations

import pytest
import torch

import fastcast as fc
from fastcast.quantizers.groups import (
    TokenGroups,
    dequantize_groups,
    group_ids,
    pad_groups,
    quantize_groups,
)
from fastcast.schemes import scheme_for

pytestmark = pytest.mark.usefixtures("single_thread")

RECIPES = {
    "current": fc.Float8CurrentScaling(),
    "delayed": fc.DelayedScaling(margin=1),
    "rowwise": fc.Float8RowwiseScaling(),
    "rowwise_hp": fc.Float8RowwiseScaling(wgrad_high_precision=True),
    "block": fc.Float8BlockScaling(),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(stochastic_rounding=False),
}
COUNTS = [5, 0, 40, 19, 1]


class _PerCall:
    """A quantizer without ``quantize_groups``: the default calls it once per group."""

    def __init__(self, inner):
        self.inner, self.fmt = inner, inner.fmt

    def quantize(self, x, *, rowwise=True, columnwise=False):
        return self.inner.quantize(x, rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("name", list(RECIPES))
def test_native_groups_equal_one_quantize_per_group(name, columnwise):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    m = torch.randn(sum(COUNTS), 64, dtype=torch.bfloat16) * 3
    m[7:9] *= 1000  # one group's scale far from the others'
    input_q, _, grad_q = _quantizers(recipe)  # (weights: the next test)
    for role, quantizer in (("input", input_q), ("grad_output", grad_q)):
        block = getattr(quantizer, "token_block", 1) if columnwise else 1
        mp, _, gid = pad_groups(m, offs, group_ids(offs, m.shape[0]), block)
        groups = TokenGroups(gid, len(COUNTS), block)
        native = quantize_groups(quantizer, mp, groups, columnwise)
        assert not isinstance(native, list), (name, role)  # no sizes read back
        per_call = quantize_groups(_PerCall(quantizer), mp, groups, columnwise)
        assert isinstance(per_call, list)
        got, want = dequantize_groups(native), dequantize_groups(per_call)
        assert torch.equal(got, want), (name, role)
        if role == "input" and name in ("current", "delayed", "nvfp4"):
            # Their scales span the rows: per group here, not the whole matrix's.
            assert not torch.equal(got, _dequantized_whole(quantizer, mp))


def _quantizers(recipe):
    return scheme_for(recipe).grouped_quantizers(recipe)


def _dequantized_whole(quantizer, m):
    return quantizer.quantize(m).dequantize(torch.float32)


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("name", list(RECIPES))
def test_experts_weights_are_quantized_expert_by_expert(name, columnwise):
    """Weights: groups of N rows known from the shape (``TokenGroups.uniform``), each
    expert's weight quantized as its own tensor (128x128 and 16x16 tiles: one
    ``quantize`` per expert, nothing read back)."""
    torch.manual_seed(2)
    w = torch.randn(3, 64, 96)
    w[1] *= 50
    quantizer = _quantizers(RECIPES[name])[1]
    groups = TokenGroups.uniform(3, 64, w.device)
    got = dequantize_groups(quantize_groups(quantizer, w.reshape(192, 96), groups, columnwise))
    layouts = {"rowwise": not columnwise, "columnwise": columnwise}
    want = torch.cat(
        [quantizer.quantize(w[e], **layouts).dequantize(torch.float32) for e in range(3)]
    )
    assert torch.equal(got, want)


def test_a_quantizer_without_the_capability_runs_the_grouped_gemm():
    """A custom recipe whose quantizer has only ``quantize``: the grouped GEMM calls it
    per token group and per expert; the result is the float64 product of those groups'
    dequantized operands."""
    recipe = fc.CustomRecipe(
        qfactory=lambda role: _PerCall(fc.schemes.scheme_for(_CURRENT).quantizer(_CURRENT, role))
    )
    torch.manual_seed(1)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    x = torch.randn(sum(COUNTS), 64, requires_grad=True)
    w = torch.randn(len(COUNTS), 32, 64, requires_grad=True)
    out = fc.grouped_mm(x, w, offs, recipe)
    start = 0
    for e, n in enumerate(COUNTS):
        if n:
            xe = fc.quantize(x.detach()[start : start + n], _CURRENT).dequantize().double()
            we = fc.quantize(w.detach()[e], _CURRENT, "weight").dequantize().double()
            want = xe @ we.T
            got = out[start : start + n].double()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())
        start += n
    out.sum().backward()
    assert w.grad.shape == w.shape and torch.all(w.grad[1] == 0)


_CURRENT = fc.Float8CurrentScaling()


def test_recipes_without_grouped_quantizers_are_refused():
    with pytest.raises(TypeError, match="128x128 tiles"):
        fc.grouped_mm(
            torch.randn(4, 128),
            torch.randn(2, 128, 128),
            torch.tensor([2, 4], dtype=torch.int32),
            fc.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
        )
