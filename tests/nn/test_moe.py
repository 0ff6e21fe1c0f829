"""Mixture of experts: the grouped GEMM of every recipe against a float64 reference built
from the dense quantizers group by group, ``fc.GroupedLinear``, the conversion of
transformers 5 experts (Qwen3-MoE, Mixtral), no host synchronisation in forward and
backward, short training runs, and ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

import fastcast as fc
from fastcast.gemm_grouped import group_ids, grouped_scaling, pad_groups

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors (see conftest)

# Recipes the grouped GEMM is checked under (NVFP4 twice: TE's defaults, with stochastic
# rounding and the Hadamard transform, and without either).
RECIPES = {
    "current": fc.Float8CurrentScaling(),
    "delayed": fc.DelayedScaling(),
    "rowwise": fc.Float8RowwiseScaling(),
    "block": fc.Float8BlockScaling(),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(),
    "nvfp4_rn": fc.NVFP4BlockScaling(stochastic_rounding=False, random_hadamard_transform=False),
}
# Operations that read a device value back to the host, or whose output shape depends on
# data (which needs such a read on a GPU).
HOST_SYNCS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "nonzero_static",
    "is_nonzero",
    "equal",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "bincount",
    "repeat_interleave",
    "tolist",
    "allclose",
}
# (Not ``_assert_async``: on a GPU it checks on the device, with no read back; the
# grouped GEMM validates its group ends with it.)

# Group sizes: an empty expert, counts that are no multiple of 16/32/128.
COUNTS = [5, 0, 40, 19, 1]


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _reference_recipe(name):
    """The dense recipe whose per-tensor quantizers a group's quantization must match
    (delayed scaling runs per-group current scaling in its format)."""
    if name == "delayed":
        return fc.Float8CurrentScaling(fp8_format=fc.Format.HYBRID)
    return RECIPES[name]


def _dq(t, recipe, role, columnwise=False, pad_to=1):
    """float64 of ``t`` quantized by the dense quantizer of ``role`` (column-wise: along
    the rows, which are zero-padded to ``pad_to`` first, as the grouped GEMM pads groups)."""
    if columnwise:
        rows = t.shape[0]
        t = torch.nn.functional.pad(t, (0, 0, 0, -rows % pad_to))
        q = fc.quantize(t, recipe, role, rowwise=False, columnwise=True)
        return q.dequantize(torch.float32).double()[:rows]
    return fc.quantize(t, recipe, role).dequantize(torch.float32).double()


def _reference(x, w, g, counts, recipe, block):
    """float64 forward, dgrad and wgrad, expert by expert."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx = torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        start += n
        xe, ge = x[rows], g[rows]
        out[rows] = _dq(xe, recipe, "input") @ _dq(w[e], recipe, "weight").T
        w_col = fc.quantize(w[e], recipe, "weight", rowwise=False, columnwise=True)
        dx[rows] = _dq(ge, recipe, "grad_output") @ w_col.dequantize(torch.float32).double()
        dw[e] = _dq(ge, recipe, "grad_output", True, block).T @ _dq(
            xe, recipe, "input", True, block
        )
    return out, dx, dw


@pytest.mark.parametrize("name", ["current", "delayed", "rowwise", "block", "mxfp8", "nvfp4_rn"])
def test_grouped_gemm_matches_float64_reference(name):
    torch.manual_seed(0)
    counts = COUNTS
    x = torch.randn(sum(counts), 64) * 3
    w = torch.randn(len(counts), 96, 64) * 0.1
    g = torch.randn(sum(counts), 96)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = fc.grouped_mm(x, w, _offs(counts), RECIPES[name])
    dx, dw = torch.autograd.grad(out, (x, w), g)
    block = grouped_scaling(RECIPES[name]).block
    ref = _reference(x.detach(), w.detach(), g, counts, _reference_recipe(name), block)
    high = x.detach().double() @ w.detach()[2].double().T
    assert (out[5:45].double() - high[5:45]).abs().max() > 1e-3  # quantized, not exact
    for got, want in zip((out, dx, dw), ref):
        scale = want.abs().max()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale)
    assert torch.all(dw[1] == 0)  # the expert without tokens gets no gradient


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 140), min_size=1, max_size=6),
    block=st.sampled_from([1, 16, 32, 128]),
)
def test_padding_of_groups_keeps_each_group_in_whole_blocks(counts, block):
    m = torch.arange(sum(counts) * 2, dtype=torch.float32).reshape(-1, 2) + 1
    offs = _offs(counts)
    padded, ends, gid = pad_groups(m, offs, group_ids(offs, m.shape[0]), block)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), ends[:-1]])
    assert torch.all(starts % block == 0)
    assert padded.shape[0] % block == 0
    at = 0
    for e, n in enumerate(counts):
        s, end = int(starts[e]), int(ends[e])
        assert end - s == -(-n // block) * block  # the group, rounded up to the block
        assert torch.equal(padded[s : s + n], m[at : at + n])
        assert torch.all(padded[s + n : end] == 0)
        assert torch.all(gid[s:end] == e)
        at += n
    assert padded.abs().sum() == m.abs().sum()  # nothing else is in the buffer


def test_all_tokens_on_one_expert_and_no_tokens():
    recipe = fc.MXFP8BlockScaling()
    torch.manual_seed(1)
    layer = fc.GroupedLinear(4, 64, 32)
    x = torch.randn(37, 64, requires_grad=True)
    offs = _offs([0, 0, 37, 0])
    with fc.autocast(recipe=recipe):
        y = layer(x, offs)
    y.sum().backward()
    dense = fc.convert(torch.nn.Linear(64, 32, bias=False))
    dense.weight.data.copy_(layer.weight.data[2])
    with fc.autocast(recipe=recipe):
        torch.testing.assert_close(y, dense(x), rtol=0, atol=0)  # one group: the dense GEMM
    assert torch.all(layer.weight.grad[[0, 1, 3]] == 0)
    empty = torch.empty(0, 64, requires_grad=True)
    with fc.autocast(recipe=recipe):
        out = layer(empty, _offs([0, 0, 0, 0]))
    out.sum().backward()
    assert out.shape == (0, 32) and empty.grad.shape == (0, 64)


def test_grouped_linear_high_precision_outside_autocast_is_bit_exact():
    torch.manual_seed(2)
    layer = fc.GroupedLinear(5, 64, 48, bias=True)
    x = torch.randn(sum(COUNTS), 64)
    offs = _offs(COUNTS)
    want = torch.cat(
        [
            x[a:b] @ layer.weight[e].T + layer.bias[e]
            for e, (a, b) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))
        ]
    )
    with torch.no_grad():
        with fc.autocast(enabled=False):
            off = layer(x, offs)
        torch.testing.assert_close(layer(x, offs), want)
        assert torch.equal(off, layer(x, offs))
        with fc.autocast(recipe=fc.Float8CurrentScaling()):
            assert not torch.equal(layer(x, offs), off)


@pytest.mark.parametrize("name", list(RECIPES))
def test_rows_past_the_last_group_change_nothing(name):
    """As torch._grouped_mm, rows past offs[-1] are ignored: whatever they hold, the valid
    rows' output and input gradient and every expert's weight gradient are the same (they
    leaked into the last group's scale and weight gradient before)."""
    recipe = RECIPES[name]
    if isinstance(recipe, fc.NVFP4BlockScaling) and recipe.stochastic_rounding:
        recipe = fc.NVFP4BlockScaling(stochastic_rounding=False)  # same draws both runs
    torch.manual_seed(3)
    w = torch.randn(3, 64, 128) / 8
    offs = _offs([32, 0, 32])  # ends 32, 32, 64: rows 64.. belong to no group
    x = torch.randn(128, 128)

    def run(tail_value):
        xs = x.clone()
        xs[64:] = tail_value
        xs.requires_grad_(True)
        ws = w.clone().requires_grad_(True)
        with fc.autocast(recipe=recipe):
            y = fc.grouped_mm(xs, ws, offs, recipe)
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
        y.backward(grad)  # the gradient of the ignored rows too: it must not count
        assert torch.all(xs.grad[64:] == 0)  # no gradient for rows no group owns
        return y[:64], xs.grad[:64], ws.grad

    for clean, noisy in zip(run(0.0), run(1e5)):
        assert torch.equal(clean, noisy)


@pytest.mark.parametrize("name", list(RECIPES))
def test_no_tokens_give_an_empty_output_and_zero_gradients(name):
    recipe = RECIPES[name]
    x = torch.empty(0, 128, requires_grad=True)
    w = torch.randn(3, 64, 128, requires_grad=True)
    with fc.autocast(recipe=recipe):
        y = fc.grouped_mm(x, w, _offs([0, 0, 0]), recipe)
    y.sum().backward()
    assert y.shape == (0, 64) and x.grad.shape == (0, 128)
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("ends", [[-1, 64, 96], [64, 32, 96], [32, 64, 200]])
@pytest.mark.parametrize("name", ["current", "block", "nvfp4"])
def test_offsets_out_of_order_or_range_are_refused(name, ends):
    recipe = RECIPES[name]
    with fc.autocast(recipe=recipe), pytest.raises(ValueError, match=r"non-decreasing.*T=128"):
        ends = torch.tensor(ends, dtype=torch.int32)
        fc.grouped_mm(torch.randn(128, 128), torch.randn(3, 64, 128), ends, recipe)


def test_grouped_linear_rejects_bad_offsets():
    layer = fc.GroupedLinear(2, 32, 32)
    with fc.autocast(recipe=fc.Float8CurrentScaling()), pytest.raises(ValueError, match="offs"):
        layer(torch.randn(4, 32), torch.tensor([2, 4]))  # int64


# -- transformers 5 experts ---------------------------------------------------------------------
def _qwen3_moe(experts=8):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def _deepseek_v3():
    cfg = transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
        n_shared_experts=1,
    )
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg)


def _routed(model, tokens=48):
    """The experts module of the model's first block and a routing for ``tokens`` tokens."""
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(3)
    h = torch.randn(tokens, 128)
    logits = torch.randn(tokens, experts.num_experts)
    weights, index = torch.topk(logits.softmax(-1), 2, dim=-1)
    return experts, h, index, weights


@pytest.mark.parametrize("build", [_qwen3_moe, _mixtral, _deepseek_v3])
def test_convert_experts_quantizes_inside_and_is_exact_outside(build):
    model = build()
    plain = copy.deepcopy(model)
    keys = list(model.state_dict())
    fc.convert(model, recipe=fc.MXFP8BlockScaling())
    experts, h, index, weights = _routed(model)
    assert type(experts).__name__.startswith("Fastcast")
    new = list(model.state_dict())
    assert [k for k in new if not k.endswith("_extra_state")] == keys  # fc.Linear adds those
    original, _, _, _ = _routed(plain)
    want = original(h, index, weights)
    with fc.autocast(recipe=fc.MXFP8BlockScaling(), enabled=False):
        assert torch.equal(experts(h, index, weights), want)
    assert torch.equal(experts(h, index, weights), want)
    for recipe in (fc.MXFP8BlockScaling(), fc.Float8RowwiseScaling()):
        with fc.autocast(recipe=recipe):
            got = experts(h, index, weights)
        assert not torch.equal(got, want)
        err = (got - want).norm() / want.norm()
        assert 1e-4 < err < 0.1, err  # FP8: near, not equal


def test_converting_a_bare_experts_module_converts_it_without_a_warning():
    """``fc.convert(experts)`` on the experts module itself (no nn.Linear anywhere):
    converted in place, no "converted no layer" warning, and again on a second call."""
    experts, h, index, weights = _routed(_qwen3_moe())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fc.convert(experts, recipe=fc.MXFP8BlockScaling()) is experts
        fc.convert(experts, recipe=fc.MXFP8BlockScaling())
    assert type(experts).__name__.startswith("Fastcast")
    plain = experts(h, index, weights)
    with fc.autocast(recipe=fc.MXFP8BlockScaling()):
        assert not torch.equal(experts(h, index, weights), plain)  # quantized inside
    with pytest.warns(UserWarning, match="converted no layer of Sequential"):
        fc.convert(torch.nn.Sequential(torch.nn.ReLU()))  # nothing to convert: still said


def test_converted_experts_round_trip_checkpoints(tmp_path):
    model = fc.convert(_qwen3_moe(), recipe=fc.Float8CurrentScaling())
    experts, h, index, weights = _routed(model)
    with torch.no_grad():
        experts.down_proj.mul_(1.5)
    model.save_pretrained(tmp_path)
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    fc.convert(loaded, recipe=fc.Float8CurrentScaling())
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "m.st")
    fresh = fc.convert(_qwen3_moe(), recipe=fc.Float8CurrentScaling())
    fresh.load_state_dict(load_file(tmp_path / "m.st"), strict=True)
    again = pickle.loads(pickle.dumps(model))
    for copy_ in (fresh, again, copy.deepcopy(model)):
        ex = copy_.model.layers[0].mlp.experts
        assert type(ex) is type(experts)
        with fc.autocast(recipe=fc.Float8CurrentScaling()):
            assert torch.equal(ex(h, index, weights), experts(h, index, weights))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)  # DCP and torch.save see the same plain tensors
    assert all(type(v) is torch.Tensor for v in model.state_dict().values())


def test_convert_respects_filter_and_alignment():
    model = _qwen3_moe()
    fc.convert(model, lambda m, name: "experts" not in name, recipe=fc.MXFP8BlockScaling())
    assert not type(model.model.layers[0].mlp.experts).__name__.startswith("Fastcast")
    model = _qwen3_moe()
    fc.convert(model, recipe=fc.CustomRecipe(qfactory=lambda role: None))
    assert not type(model.model.layers[0].mlp.experts).__name__.startswith("Fastcast")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_no_host_sync_in_expert_forward_and_backward():
    model = fc.convert(_qwen3_moe(), recipe=fc.MXFP8BlockScaling())
    experts, h, index, weights = _routed(model)
    # The detector finds the host reads of transformers' eager experts (nonzero).
    model.config._experts_implementation = "eager"
    with _Ops() as ops:
        experts(h, index, weights)
    assert HOST_SYNCS & set(ops.names)
    h.requires_grad_(True)
    layer = fc.GroupedLinear(5, 64, 32)
    x = torch.randn(sum(COUNTS), 64, requires_grad=True)
    for recipe in RECIPES.values():
        with _Ops() as ops:
            with fc.autocast(recipe=recipe):
                out = experts(h, index, weights)
                y = layer(x, _offs(COUNTS))
            (out.sum() + y.sum()).backward()
        found = HOST_SYNCS & set(ops.names)
        assert not found, f"{type(recipe).__name__}: {found}"
        assert "_grouped_mm" in ops.names


def _moe_block(seed=0):
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=128,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    torch.manual_seed(seed)
    cfg._experts_implementation = "grouped_mm"  # what a model built from cfg would set
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():  # (transformers initialises parameters in the model, not here)
        for p in block.parameters():
            p.normal_(0.0, 0.1)
    return block


def test_training_steps_track_fp32():
    """30 Adam steps of a Qwen3-MoE block fitting a teacher block, per recipe; the held-out
    loss (evaluated in FP32) ends within 1% of FP32 training (3% for NVFP4)."""
    teacher = _moe_block(seed=1)
    gen = torch.Generator().manual_seed(0)
    train = [torch.randn(4, 16, 128, generator=gen) for _ in range(30)]
    held = torch.randn(8, 32, 128, generator=gen)
    with torch.no_grad():
        targets = [teacher(x) for x in train]
        held_target = teacher(held)

    def run(recipe):
        student = fc.convert(_moe_block(seed=2), recipe=recipe)
        opt = torch.optim.Adam(student.parameters(), lr=3e-3)
        for x, t in zip(train, targets):
            with fc.autocast(recipe=recipe, enabled=recipe is not None):
                loss = torch.nn.functional.mse_loss(student(x), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            return torch.nn.functional.mse_loss(student(held), held_target).item()

    start = torch.nn.functional.mse_loss(_moe_block(seed=2)(held), held_target).item()
    fp32 = run(None)
    assert fp32 < 0.8 * start  # it learns: the comparison means something
    for name, recipe in RECIPES.items():
        loss = run(recipe)
        tolerance = 0.03 if name.startswith("nvfp4") else 0.01
        assert abs(loss - fp32) <= tolerance * fp32, (name, loss, fp32)


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_moe_block_has_no_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend

    block = fc.convert(_moe_block(), recipe=fc.Float8RowwiseScaling())
    x = torch.randn(2, 20, 128)
    recipe = fc.Float8RowwiseScaling()

    def step(inp):
        with fc.autocast(recipe=recipe):
            return block(inp)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    got = compiled(x)
    torch.testing.assert_close(got, step(x), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
    got.sum().backward()
    assert block.experts.gate_up_proj.grad is not None


@pytest.mark.parametrize("name", ["current", "rowwise"])
def test_hardware_operands_pass_the_kernels_checks(name):
    """The operands fastcast hands ``torch._scaled_grouped_mm`` (sm90/sm100) pass its
    checks (dtypes, row/column-major layouts, 16-byte strides, scale shapes), run on meta
    tensors here; and their dequantized product is the emulation's."""
    from fastcast.gemm_grouped import operands_2d_2d, operands_2d_3d

    s = grouped_scaling(fc.Float8CurrentScaling(fp8_format=fc.Format.E4M3))
    if name == "rowwise":
        s = grouped_scaling(fc.Float8RowwiseScaling())
    counts = [16, 0, 48, 32]
    offs = _offs(counts)
    torch.manual_seed(4)
    x, w, g = torch.randn(96, 64), torch.randn(4, 32, 64), torch.randn(96, 32)
    gid = group_ids(offs, 96)
    forward = operands_2d_3d(x, w, gid, s, ("input", "weight"))
    gp, offs_p, gid_p = pad_groups(g, offs, gid, 16)
    xp, _, _ = pad_groups(x, offs, gid, 16)
    wgrad = operands_2d_2d(gp, xp, s, gid_p, 4)
    for args, o in ((forward, offs), (wgrad, offs_p)):
        meta = [t.to("meta") for t in args]
        out = torch.ops.aten._scaled_grouped_mm(*meta, offs=o.to("meta"), out_dtype=torch.bfloat16)
        assert out.dtype == torch.bfloat16
    a, b, sa, sb = forward
    got = torch._grouped_mm(a.float() * sa[:, None], (b.float() * sb[:, None, :]), offs=offs)
    want = fc.grouped_mm(
        x,
        w,
        offs,
        fc.Float8RowwiseScaling()
        if name == "rowwise"
        else fc.Float8CurrentScaling(fp8_format=fc.Format.E4M3),
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_experts_in_their_precision(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    model = fc.convert(_qwen3_moe(), recipe=fc.Float8RowwiseScaling())
    experts, h, index, weights = _routed(model)
    h.requires_grad_(True)
    grads = []
    for checkpointed in (False, True):
        with fc.autocast(recipe=fc.Float8RowwiseScaling()):
            if checkpointed:
                out = checkpoint(experts, h, index, weights, use_reentrant=use_reentrant)
            else:
                out = experts(h, index, weights)
        h.grad = experts.down_proj.grad = None
        out.square().sum().backward()  # (reentrant checkpointing refuses autograd.grad)
        grads.append((h.grad, experts.down_proj.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
