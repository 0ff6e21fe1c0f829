"""NVFP4's random Hadamard transform (RHT) of the weight-gradient operands, against a
float64 transform built here from the definition (Sylvester's construction by Kronecker
products, TE's sign vector written out), and ``fc.keep_high_precision``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import fastcast as fc
from fastcast.quantizers.nvfp4 import NVFP4Quantizer
from fastcast.reference import hadamard
from fastcast.schemes import scheme_for

F64 = torch.float64
# TransformerEngine's get_wgrad_sign_vector().
TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def rht64(signs) -> torch.Tensor:
    """``diag(signs) @ H16 / 4`` in float64, H16 = H2 (x) H2 (x) H2 (x) H2."""
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=F64)
    h = h2
    for _ in range(3):
        h = torch.kron(h, h2)
    return torch.diag(torch.tensor(signs, dtype=F64)) @ h / 4


def transform64(x: torch.Tensor, signs) -> torch.Tensor:
    """Every column of ``x`` [R, K] in blocks of 16 rows, ``v -> v @ M`` (float64)."""
    rows, cols = x.shape
    blocks = x.to(F64).t().reshape(cols, rows // 16, 16)
    return (blocks @ rht64(signs)).reshape(cols, rows).t()


def test_default_signs_are_transformer_engines():
    assert list(hadamard.sign_vector()) == TE_SIGNS
    assert fc.NVFP4BlockScaling().rht_seed is None
    q = fc.schemes.scheme_for(fc.NVFP4BlockScaling()).quantizer(fc.NVFP4BlockScaling(), "input")
    assert list(q.rht) == TE_SIGNS


def test_matrix_is_orthogonal_and_the_definitions():
    for signs in (TE_SIGNS, hadamard.sign_vector(5)):
        m = hadamard.rht_matrix(signs).to(F64)
        assert torch.equal(m, rht64(signs))  # +-0.25 entries: exact in FP32
        assert torch.equal(m @ m.t(), torch.eye(16, dtype=F64))


def test_transform_then_inverse_recovers_the_input():
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 100
    y = hadamard.transform_columns(x, hadamard.TE_SIGNS)
    # Each output is a 16-term FP32 sum: within a few FP32 roundings of float64's.
    expected = transform64(x, TE_SIGNS)
    assert (y.to(F64) - expected).abs().max() <= 16 * 2**-24 * x.abs().max()
    back = hadamard.transform_columns(y, hadamard.TE_SIGNS, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=32 * 2**-24 * x.abs().max().item())
    rows = hadamard.transform_rows(x.t(), hadamard.TE_SIGNS)
    assert torch.equal(rows, y.t())


def test_seeded_signs_are_reproducible_across_processes():
    here = [hadamard.sign_vector(s) for s in (0, 1, 12345)]
    assert here[0] == hadamard.sign_vector(0) and len(set(here)) == 3
    assert all(len(v) == 16 and set(v) <= {1, -1} for v in here)
    code = (
        "from fastcast.reference import hadamard;"
        "print([hadamard.sign_vector(s) for s in (0, 1, 12345)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == repr(here)
    with pytest.raises(ValueError, match="seed must be an int"):
        hadamard.sign_vector(1.5)


def test_columnwise_layout_is_the_quantized_transform_under_its_own_scale():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=gen)
    x[5, :16] = 40.0  # a constant block column: the transform piles it onto one element
    q = NVFP4Quantizer(rht=hadamard.TE_SIGNS).quantize(x, columnwise=True)
    plain = NVFP4Quantizer().quantize(x)
    # The row-wise layout is untouched.
    assert torch.equal(q.data, plain.data) and torch.equal(
        q.global_scale_inv, plain.global_scale_inv
    )
    # The column-wise one is that of the transform (rounded to FP32), with its own amax.
    transformed = hadamard.transform_columns(x, hadamard.TE_SIGNS)
    ref = NVFP4Quantizer().quantize(transformed, rowwise=False, columnwise=True)
    assert torch.equal(q.data_t, ref.data_t) and torch.equal(q.scale_inv_t, ref.scale_inv_t)
    assert torch.equal(q.global_scale_inv_t, ref.global_scale_inv)
    assert q.global_scale_inv_t.item() != q.global_scale_inv.item()
    # dequantize undoes the transform, whichever layout it reads: the inverse (float64)
    # of the decoded transformed layout
    operand = ref.columnwise_operand().dequantize_rowwise_2d().to(F64)  # [K, R]
    inverse = (operand.reshape(32, 4, 16) @ rht64(TE_SIGNS).t()).reshape(32, 64)
    alone = NVFP4Quantizer(rht=hadamard.TE_SIGNS).quantize(x, rowwise=False, columnwise=True)
    torch.testing.assert_close(alone.dequantize().to(F64), inverse.t(), rtol=2**-20, atol=1e-6)
    torch.testing.assert_close(q.t().dequantize().to(F64), inverse, rtol=2**-20, atol=1e-6)
    # and is within NVFP4's error of x
    assert (alone.dequantize() - x).norm() / x.norm() < 0.2


@pytest.mark.parametrize("stochastic", [False, True])
def test_linear_wgrad_is_the_product_of_the_transformed_operands(stochastic):
    """fc.Linear's weight gradient under NVFP4 with the transform equals the float64
    product of the NVFP4 quantizations of the transformed gradient and input (the
    transform checked against float64's), an estimate of ``g^T x``."""
    torch.manual_seed(2)
    lin = fc.Linear(64, 32, bias=False)
    x = torch.randn(48, 64, requires_grad=True)
    g = torch.randn(48, 32)
    recipe = fc.NVFP4BlockScaling(stochastic_rounding=stochastic)
    torch.manual_seed(3)
    with fc.autocast(recipe=recipe):
        y = lin(x)
    y.backward(g)
    # The FP32 transforms the quantizers take agree with float64's to FP32 rounding.
    for v in (x.detach(), g):
        err = (hadamard.transform_columns(v, hadamard.TE_SIGNS) - transform64(v, TE_SIGNS)).abs()
        assert err.max() <= 16 * 2**-24 * v.abs().max()
    # Replay the draws: forward quantizes x (no rounding draws), backward g's row-wise
    # layout then its transformed column-wise one.
    torch.manual_seed(3)
    grad_q = NVFP4Quantizer(stochastic_rounding=stochastic)
    if stochastic:
        grad_q.quantize(g)  # the dgrad layout's draws
    g_op = grad_q.quantize(
        hadamard.transform_columns(g, hadamard.TE_SIGNS), rowwise=False, columnwise=True
    )
    x_op = NVFP4Quantizer().quantize(
        hadamard.transform_columns(x.detach(), hadamard.TE_SIGNS), rowwise=False, columnwise=True
    )
    a = g_op.columnwise_operand().dequantize_rowwise_2d().to(F64)  # [N, M]
    b = x_op.columnwise_operand().dequantize_rowwise_2d().to(F64)  # [K, M]
    expected = a @ b.t()
    err = (lin.weight.grad.to(F64) - expected).abs().max()
    assert err <= 1e-5 * expected.abs().max()
    # and it is an estimate of g^T x
    exact = g.to(F64).t() @ x.detach().to(F64)
    assert ((expected - exact).norm() / exact.norm()) < 0.3


def test_stochastic_rounding_is_unbiased_through_the_recipe():
    """The recipe's gradient quantizer (stochastic by default) is unbiased: the mean of
    many quantizations of one gradient converges to it (fixed seed)."""
    recipe = fc.NVFP4BlockScaling()
    grad_q = fc.schemes.scheme_for(recipe).quantizer(recipe, "grad_output")
    assert grad_q.stochastic_rounding
    g = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(5)
    runs = 2000
    total = torch.zeros(16, 64, dtype=F64)
    for _ in range(runs):
        total += grad_q.quantize(g, generator=gen).dequantize().to(F64)
    mean = total / runs
    # Each draw errs by at most one grid step (<= s_dec * 2): the mean's error shrinks as
    # 1/sqrt(runs); round-to-nearest's bias would not.
    nearest = NVFP4Quantizer().quantize(g).dequantize().to(F64)
    bias_nearest = (nearest - g.to(F64)).abs().mean()
    bias_mean = (mean - g.to(F64)).abs().mean()
    assert bias_mean < bias_nearest / 5


# -- keeping layers in high precision -------------------------------------------------
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_keep_high_precision_keeps_the_lm_head_of_a_llama():
    model = _tiny_llama()
    recipe = fc.NVFP4BlockScaling()
    fc.convert(model, fc.keep_high_precision(model), recipe=recipe)
    assert type(model.lm_head) is torch.nn.Linear
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sum(isinstance(m, fc.Linear) for m in linears) == len(linears) - 1 == 14
    # The converted layers run NVFP4, the head high precision: the logits are exactly the
    # head applied in FP32 to its (quantized-path) input.
    seen = {}
    model.lm_head.register_forward_hook(lambda mod, inp, out: seen.update(inp=inp[0], out=out))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with fc.autocast(recipe=recipe):
        out = model(input_ids=ids, labels=ids)
    assert torch.equal(seen["out"], torch.nn.functional.linear(seen["inp"], model.lm_head.weight))
    out.loss.backward()
    assert model.lm_head.weight.grad is not None
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_keep_high_precision_first_last_and_names():
    model = _tiny_llama()
    keep = fc.keep_high_precision(model, first=1, last=2, names=["model.layers.1.mlp"])
    fc.convert(model, keep)
    kept = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert kept == {
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
        "lm_head",
    }
    with pytest.raises(ValueError, match="last must be an int >= 0"):
        fc.keep_high_precision(model, last=-1)


def test_te_rounding_option_quantizes_the_transform_rounded_to_bf16():
    """``rht_round_to_input_dtype``: the column-wise layout of a bf16 input is that of
    its exact (float64) transform rounded once to bf16, as TransformerEngine computes it;
    the default (FP32 transform) differs from it in codes and in the tensor scale."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(256, 64, generator=gen) * torch.rand(256, 1, generator=gen) * 3).bfloat16()
    te_like = transform64(x, TE_SIGNS).to(torch.bfloat16)  # one rounding, from float64
    ref = NVFP4Quantizer().quantize(te_like, rowwise=False, columnwise=True)
    recipe = fc.NVFP4BlockScaling(rht_round_to_input_dtype=True)
    q = scheme_for(recipe).quantizer(recipe, "grad_output")
    q = dataclasses.replace(q, stochastic_rounding=False)
    assert q.rht_round_to_input_dtype
    got = q.quantize(x, rowwise=True, columnwise=True)
    assert torch.equal(got.data_t, ref.data_t) and torch.equal(got.scale_inv_t, ref.scale_inv_t)
    assert torch.equal(got.global_scale_inv_t, ref.global_scale_inv)
    default = NVFP4Quantizer(rht=hadamard.TE_SIGNS).quantize(x, rowwise=False, columnwise=True)
    assert not torch.equal(default.data_t, got.data_t)
    assert default.global_scale_inv_t.item() != got.global_scale_inv_t.item()
    # The row-wise layout and FP32 inputs are unaffected.
    plain = NVFP4Quantizer().quantize(x)
    assert torch.equal(got.data, plain.data)
    x32 = x.float()
    a = NVFP4Quantizer(rht=hadamard.TE_SIGNS).quantize(x32, rowwise=False, columnwise=True)
    b = dataclasses.replace(q, rht_round_to_input_dtype=True).quantize(
        x32, rowwise=False, columnwise=True
    )
    assert torch.equal(a.data_t, b.data_t)
    with pytest.raises(ValueError, match="rht_round_to_input_dtype must be a bool"):
        fc.NVFP4BlockScaling(rht_round_to_input_dtype=1)
