"""A recipe defined outside the package, through the extension API alone (a ``Recipe``
subclass, a ``Scheme`` registered with ``register_scheme``, a quantizer that says what
it is: ``docs/architecture.md``, "Adding a recipe"), runs unchanged through every layer
kind and parallelism, each checked against a float64 reference or one process.

The recipe: per-tensor FP8 whose scale is a power of two with ``margin`` powers of two
of headroom (``2**(floor(log2(fmt_max / amax)) - margin)``), E4M3 forward, E5M2
gradients. Nothing in fastcast names it; the grouped GEMMs quantize through the scheme's
``grouped_quantizers`` (its quantizers, called per token group). Tensor and
sequence parallelism and the FSDP2 gather, on two ranks:
``tests/distributed/test_extension_recipe_ranks.py``.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import fastcast as fc
from fastcast.quantizers.reduction import GroupMax
from fastcast.recipe import Recipe
from fastcast.schemes import Scheme, register_scheme
from fastcast.tensor import Float8Tensor

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
WHOLE = (0, 0)  # one scale for the whole tensor, along both dims


# -- the recipe, its scheme and its quantizer ----------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, repr=False, eq=False)
class Pow2TensorScaling(Recipe):
    """Per-tensor FP8, power-of-two scales, ``margin`` powers of two below the max."""

    margin: int = 1

    def _check(self) -> None:
        if type(self.margin) is not int or not 0 <= self.margin <= 16:
            raise ValueError(
                f"Pow2TensorScaling: margin must be an int in [0, 16], got {self.margin!r}"
            )


@dataclasses.dataclass(frozen=True)
class Pow2Quantizer:
    """The tensor's amax (through ``reduce`` when it is a shard) to a power-of-two scale."""

    fmt: str
    margin: int
    reduce: Any = None  # amax -> amax, max-reduced in place over the shards' ranks

    scale_blocks: ClassVar = (WHOLE, WHOLE)
    pure: ClassVar[bool] = True

    def over_shards(self, reduce: Any, dim: int) -> Pow2Quantizer:
        return self if self.reduce is not None else dataclasses.replace(self, reduce=reduce)

    def shard_amax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.detach().abs().amax().float()

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        ratio = torch.finfo(FP8[self.fmt]).max / amax
        scale = torch.exp2(torch.floor(torch.log2(ratio)) - self.margin)
        return torch.where(torch.isfinite(ratio) & (amax > 0), scale, torch.ones_like(scale))

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> Float8Tensor:
        amax = x.detach().abs().amax().float()
        if self.reduce is not None:
            self.reduce(amax)
        scale = self.scale_for(amax)
        fmax = torch.finfo(FP8[self.fmt]).max
        codes = (x.float() * scale).clamp(-fmax, fmax).to(FP8[self.fmt])
        scale_inv = scale.reciprocal()
        codes_t = codes.reshape(-1, x.shape[-1]).t().contiguous() if columnwise else None
        return Float8Tensor.assemble(
            self.fmt,
            x.shape,
            x.dtype,
            codes if rowwise else None,
            scale_inv if rowwise else None,
            WHOLE,
            codes_t,
            scale_inv if columnwise else None,
            WHOLE,
        )


@register_scheme(Pow2TensorScaling)
class Pow2Scheme(Scheme):
    """Stateless; activation and gradient amaxes reduced over the autocast's group."""

    family = "tensorwise"

    def quantizer(self, recipe: Pow2TensorScaling, role: str, group: Any = None) -> Pow2Quantizer:
        fmt = "e5m2" if role == "grad_output" else "e4m3"
        reduce = None if role == "weight" or group is None else GroupMax(group)
        return Pow2Quantizer(fmt, recipe.margin, reduce)


RECIPE = Pow2TensorScaling(margin=2)


# -- the float64 reference ------------------------------------------------------------------


def dq64(t: torch.Tensor, fmt: str, margin: int = RECIPE.margin) -> torch.Tensor:
    """``t`` quantized as the recipe defines it, in float64, torch's own FP8 cast."""
    t = t.detach().double()
    fmax = torch.finfo(FP8[fmt]).max
    amax = t.abs().max().item()
    scale = 2.0 ** (math.floor(math.log2(fmax / amax)) - margin) if amax > 0 else 1.0
    return (t * scale).clamp(-fmax, fmax).to(FP8[fmt]).double() / scale


def linear64(x, w, b, g):
    """Output and (input, weight, bias) gradients of ``x @ w.T + b`` with every GEMM
    operand quantized, for output gradient ``g``."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    xq, wq, gq = dq64(x2, "e4m3"), dq64(w, "e4m3"), dq64(g2, "e5m2")
    out = xq @ wq.T + (0 if b is None else b.double())
    return out.reshape(*x.shape[:-1], -1), (gq @ wq).reshape(x.shape), gq.T @ xq, g2.double().sum(0)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """FP32 accumulation of exactly representable products against float64."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * scale)


# -- single process --------------------------------------------------------------------------


def test_the_scheme_answers_every_query_from_the_quantizer():
    from fastcast.schemes import recipe_support, scheme_for  # noqa: PLC0415

    scheme = scheme_for(RECIPE)
    assert scheme.scale_blocks(RECIPE, "input") == (WHOLE, WHOLE)
    assert scheme.weight_format(RECIPE) == "e4m3" and not scheme.stateful
    assert recipe_support(RECIPE, "cpu")[0]
    q = fc.quantize(torch.tensor([[3.0, -1.0]]), RECIPE)  # 448/3 -> 2**7, margin 2 -> 2**5
    assert q.scale_inv.item() == 2.0**-5 and torch.equal(
        q.dequantize(), torch.tensor([[3.0, -1.0]])
    )
    with pytest.raises(ValueError, match="margin must be an int"):
        Pow2TensorScaling(margin=-1)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_and_backward_match_float64(bias):
    torch.manual_seed(0)
    layer = fc.Linear(64, 32, bias=bias)
    x = torch.randn(2, 8, 64, requires_grad=True)
    g = torch.randn(2, 8, 32) * 1e-3
    with fc.autocast(recipe=RECIPE):
        y = layer(x)
    y.backward(g)
    out, dx, dw, db = linear64(x, layer.weight, layer.bias, g)
    close(y, out)
    close(x.grad, dx)
    close(layer.weight.grad, dw)
    if bias:
        close(layer.bias.grad, db)


def test_conv1d_matches_float64():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(1)
    model = nn.Sequential(pytorch_utils.Conv1D(32, 64))
    fc.convert(model)
    conv = model[0]
    assert isinstance(conv, fc.Conv1D)
    x = torch.randn(16, 64, requires_grad=True)
    g = torch.randn(16, 32)
    with fc.autocast(recipe=RECIPE):
        y = conv(x)
    y.backward(g)
    out, dx, dw, db = linear64(x, conv.weight.t(), conv.bias, g)
    close(y, out)
    close(x.grad, dx)
    close(conv.weight.grad, dw.t())
    close(conv.bias.grad, db)


def test_save_and_load_round_trip(tmp_path):
    torch.manual_seed(2)
    model = fc.convert(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)), recipe=RECIPE
    )
    assert not any(k.endswith("_extra_state") for k in model.state_dict())  # stateless
    path = tmp_path / "model.pt"
    torch.save({"model": model.state_dict(), "recipe": RECIPE}, path)
    loaded = torch.load(path, weights_only=False)
    fresh = fc.convert(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)), recipe=RECIPE
    )
    fresh.load_state_dict(loaded["model"])
    assert loaded["recipe"] == RECIPE and pickle.loads(pickle.dumps(RECIPE)) == RECIPE
    x = torch.randn(8, 64)
    with fc.autocast(recipe=loaded["recipe"]):
        assert torch.equal(fresh(x), model(x))
        hidden = fc.Linear(64, 64)
        hidden.load_state_dict(model[0].state_dict())
        out = hidden(x)
    close(out, linear64(x, model[0].weight, model[0].bias, torch.zeros(8, 64))[0])


def _grouped64(x, weight, counts):
    outs, start = [], 0
    for e, n in enumerate(counts):
        rows = x[start : start + n]
        start += n
        if n:
            outs.append(dq64(rows, "e4m3") @ dq64(weight[e], "e4m3").T)
        else:
            outs.append(torch.zeros(0, weight.shape[1], dtype=torch.float64))
    return torch.cat(outs)


def test_grouped_linear_matches_float64_per_token_group():
    torch.manual_seed(3)
    counts = [5, 0, 40, 19]
    layer = fc.GroupedLinear(4, 64, 32)
    x = torch.randn(sum(counts), 64)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    with fc.autocast(recipe=RECIPE), torch.no_grad():
        y = layer(x, offs)
    close(y, _grouped64(x, layer.weight, counts))


def test_converted_experts_match_float64():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    fc.convert(model, recipe=RECIPE)
    experts = model.model.layers[0].mlp.experts
    h = torch.randn(24, 64)
    weights, index = torch.topk(torch.randn(24, 4).softmax(-1), 2, dim=-1)
    with fc.autocast(recipe=RECIPE), torch.no_grad():
        got = experts(h, index, weights)
    want = torch.zeros(24, 64, dtype=torch.float64)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    for e in range(4):
        pos, tokens = torch.where(index.t() == e)
        if tokens.numel() == 0:
            continue
        gate, up = (dq64(h[tokens], "e4m3") @ dq64(gate_up[e], "e4m3").T).chunk(2, dim=-1)
        inner = (torch.nn.functional.silu(gate) * up).float()  # what the next GEMM quantizes
        out = dq64(inner, "e4m3") @ dq64(down[e], "e4m3").T
        want.index_add_(0, tokens, out * weights[tokens, pos, None].double())
    # The intermediate is rounded to FP32 in a GEMM of another summation order: a code
    # may differ by one step now and then, far less than FP8's own error.
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 2e-3, err


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_fullgraph_matches_float64():
    torch._dynamo.reset()
    torch.manual_seed(4)
    layer = fc.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    g = torch.randn(16, 32)

    def step(inp: torch.Tensor) -> torch.Tensor:
        with fc.autocast(recipe=RECIPE):
            return layer(inp)

    y = torch.compile(step, fullgraph=True)(x)
    y.backward(g)
    out, dx, dw, db = linear64(x, layer.weight, layer.bias, g)
    close(y, out)
    close(x.grad, dx)
    close(layer.weight.grad, dw)
