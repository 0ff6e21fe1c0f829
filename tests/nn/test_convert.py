"""fc.convert: in-place swap of nn.Linear layers, and a small end-to-end training run."""

from __future__ import annotations

import copy
import functools
import logging
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from _contexts import isolated
from torch import nn

import fastcast as fc

pytestmark = pytest.mark.usefixtures("single_thread")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 128)
        self.odd = nn.Linear(64, 40)  # 40: not a multiple of 16
        self.out = nn.Linear(128, 64, bias=False)
        self.act = nn.GELU()

    def forward(self, x):
        return self.out(self.act(self.proj(x))) + self.odd(x).sum(-1, keepdim=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.heads = nn.ModuleDict({"a": nn.Linear(64, 96), "b": nn.Linear(64, 48)})
        self.norm = nn.LayerNorm(64)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(self.norm(x))
        return torch.cat([self.heads["a"](x), self.heads["b"](x)], dim=-1)


def _linears(module):
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}


def _params(module):
    return {name: p for name, p in module.named_parameters()}


def test_swaps_eligible_layers_in_place_sharing_parameters():
    torch.manual_seed(0)
    net = Net()
    params = _params(net)
    before = _linears(net)
    assert fc.convert(net) is net
    after = {name: m for name, m in net.named_modules() if name in before}
    converted = {n for n, m in after.items() if isinstance(m, fc.Linear)}
    assert converted == {
        "blocks.0.proj",
        "blocks.0.out",
        "blocks.1.proj",
        "blocks.1.out",
        "heads.a",
        "heads.b",
    }
    for name in ("blocks.0.odd", "blocks.1.odd"):  # left alone
        assert type(after[name]) is nn.Linear and after[name] is before[name]
    for name, p in _params(net).items():
        assert p is params[name], name  # the same Parameter objects, not copies
    for name in converted:
        old, new = before[name], after[name]
        assert new.weight is old.weight and new.bias is old.bias
        assert (new.in_features, new.out_features) == (old.in_features, old.out_features)
    assert after["blocks.0.out"].bias is None


def test_outputs_and_gradients_unchanged_outside_autocast():
    torch.manual_seed(1)
    net = Net()
    ref = copy.deepcopy(net)
    fc.convert(net)
    x = torch.randn(4, 8, 64)
    y, y_ref = net(x), ref(x)
    assert torch.equal(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


ODD = {"blocks.0.odd", "blocks.1.odd"}  # 64 -> 40: never converted


@pytest.mark.parametrize(
    "recipe, kept",
    [
        (None, ODD),  # 16-aligned layers convert (heads.b: 64 -> 48 included)
        (fc.Float8CurrentScaling(), ODD),
        (fc.Float8BlockScaling(), ODD),
        (fc.NVFP4BlockScaling(), ODD | {"heads.b"}),  # the output head, kept by default
        (fc.MXFP8BlockScaling(), ODD | {"heads.b"}),  # 48 is not a multiple of 32
    ],
    ids=["default", "current", "block", "nvfp4", "mxfp8"],
)
def test_alignment_depends_on_the_recipe(recipe, kept):
    net = Net()
    fc.convert(net, recipe=recipe)
    assert {n for n, m in net.named_modules() if type(m) is nn.Linear} == kept


@pytest.fixture
def head_not_yet_warned(monkeypatch):
    """As in a fresh process: the default-kept head not logged at WARNING yet."""
    monkeypatch.setattr(sys.modules["fastcast.nn.convert"], "_head_warned", False)


def test_nvfp4_keeps_the_output_head_by_default_and_says_so_once(caplog, head_not_yet_warned):
    caplog.set_level(logging.INFO, logger="fastcast")
    recipe = fc.NVFP4BlockScaling()
    for _ in range(2):
        net = Net()
        head = net.heads["b"]  # the last nn.Linear registered
        fc.convert(net, recipe=recipe)
        assert type(head) is nn.Linear and net.heads["b"] is head
        assert isinstance(net.heads["a"], fc.Linear) and isinstance(net.blocks[0].proj, fc.Linear)
    notes = [r for r in caplog.records if "keeps the output head" in r.getMessage()]
    assert [r.levelno for r in notes] == [logging.WARNING, logging.INFO]  # loud once
    message = notes[0].getMessage()
    assert "NVFP4BlockScaling" in message and "'heads.b'" in message
    assert "keep_head=False" in message  # the one-line way to change it
    summary = [r.getMessage() for r in caplog.records if "converted 5" in r.getMessage()]
    assert summary and "heads.b (the output head, kept in high precision" in summary[0]


def test_keep_head_false_converts_it_and_other_recipes_keep_nothing(caplog, head_not_yet_warned):
    caplog.set_level(logging.INFO, logger="fastcast")
    net = fc.convert(Net(), recipe=fc.NVFP4BlockScaling(), keep_head=False)
    assert isinstance(net.heads["b"], fc.Linear)
    for recipe in (None, fc.Float8CurrentScaling(), fc.DelayedScaling()):
        net = fc.convert(Net(), recipe=recipe)
        assert isinstance(net.heads["a"], fc.Linear) and isinstance(net.heads["b"], fc.Linear)
    assert not [r for r in caplog.records if "keeps the output head" in r.getMessage()]
    # keep_head=True keeps it under any recipe, or none (the recipe known only later).
    for recipe in (None, fc.Float8CurrentScaling()):
        net = fc.convert(Net(), recipe=recipe, keep_head=True)
        assert type(net.heads["b"]) is nn.Linear and isinstance(net.heads["a"], fc.Linear)


def test_the_kept_head_combines_with_the_users_filter_and_is_not_warned_about():
    net = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fc.convert(
            net, lambda m, name: not name.startswith("blocks.1"), recipe=fc.NVFP4BlockScaling()
        )
    assert type(net.heads["b"]) is nn.Linear  # the head, whatever the filter says
    assert type(net.blocks[1].proj) is nn.Linear  # the filter
    assert isinstance(net.blocks[0].proj, fc.Linear) and isinstance(net.heads["a"], fc.Linear)
    # A single layer is all there is: converted.
    lin = fc.convert(nn.Linear(32, 32), recipe=fc.NVFP4BlockScaling())
    assert type(lin) is fc.Linear
    seq = fc.convert(nn.Sequential(nn.Linear(32, 32)), recipe=fc.NVFP4BlockScaling())
    assert type(seq[0]) is fc.Linear


def test_alignment_checks_both_features():
    seq = nn.Sequential(nn.Linear(64, 24), nn.Linear(24, 64), nn.Linear(64, 64), nn.Linear(8, 8))
    fc.convert(seq)
    assert [type(m) for m in seq] == [nn.Linear, nn.Linear, fc.Linear, nn.Linear]


def test_module_filter_fn_sees_module_and_fully_qualified_name():
    net = Net()
    seen = []

    def only_heads(module, fqn):
        seen.append((type(module), fqn))
        return fqn.startswith("heads.")

    fc.convert(net, only_heads)
    assert all(t is nn.Linear for t, _ in seen)
    names = {fqn for _, fqn in seen}
    assert {"blocks.0.proj", "blocks.1.out", "heads.a", "heads.b"} <= names
    converted = {n for n, m in net.named_modules() if isinstance(m, fc.Linear)}
    assert converted == {"heads.a", "heads.b"}
    # keyword form with a recipe as well
    net2 = Net()
    fc.convert(
        net2, module_filter_fn=lambda m, fqn: m.out_features == 128, recipe=fc.MXFP8BlockScaling()
    )
    assert {n for n, m in net2.named_modules() if isinstance(m, fc.Linear)} == {
        "blocks.0.proj",
        "blocks.1.proj",
    }


def test_bare_linear_is_converted_and_returned():
    lin = nn.Linear(32, 64)
    new = fc.convert(lin)
    assert isinstance(new, fc.Linear)
    assert new.weight is lin.weight and new.bias is lin.bias
    kept = nn.Linear(32, 64)
    assert fc.convert(kept, lambda m, fqn: False) is kept
    odd = nn.Linear(30, 64)
    assert fc.convert(odd) is odd


def test_converting_twice_changes_nothing_more():
    net = fc.convert(Net())
    mods = dict(net.named_modules())
    fc.convert(net)
    assert dict(net.named_modules()) == mods


def test_subclasses_of_linear_are_left_alone():
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    seq = nn.Sequential(MyLinear(64, 64), nn.Linear(64, 64))
    model = nn.ModuleDict({"mha": mha, "seq": seq})
    fc.convert(model)
    assert type(seq[0]) is MyLinear and type(seq[1]) is fc.Linear
    # MultiheadAttention's out_proj is a Linear subclass that it calls functionally.
    assert not isinstance(mha.out_proj, fc.Linear)
    x = torch.randn(2, 32, 64)
    with fc.autocast(recipe=fc.Float8CurrentScaling()):
        out, _ = mha(x, x, x)
        seq(out).sum().backward()
    assert mha.out_proj.weight.grad is not None


def test_optimizer_built_before_convert_updates_the_converted_model():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fc.convert(model)
    assert isinstance(model[0], fc.Linear) and isinstance(model[2], fc.Linear)
    before = [p.detach().clone() for p in model.parameters()]
    with fc.autocast(recipe=fc.Float8CurrentScaling()):
        loss = model(torch.randn(64, 64)).square().mean()
    loss.backward()
    opt.step()
    for p, old in zip(model.parameters(), before):
        assert not torch.equal(p, old)
        torch.testing.assert_close(p.detach(), old - 0.1 * p.grad)


def test_hooks_mode_and_requires_grad_survive():
    lin = nn.Linear(64, 64)
    lin.weight.requires_grad_(False)
    seq = nn.Sequential(lin).eval()
    calls = []
    h1 = lin.register_forward_hook(lambda m, i, o: calls.append("fwd"))
    lin.register_forward_pre_hook(lambda m, i: calls.append("pre"))
    fc.convert(seq)
    assert isinstance(seq[0], fc.Linear)
    assert not seq[0].training
    assert not seq[0].weight.requires_grad and seq[0].bias.requires_grad
    seq(torch.randn(4, 64))
    assert calls == ["pre", "fwd"]
    h1.remove()
    seq(torch.randn(4, 64))
    assert calls == ["pre", "fwd", "pre"]


def test_state_dict_keys_stay_plain_but_for_delayed_scaling():
    net = Net()
    old_sd = copy.deepcopy(net.state_dict())
    fc.convert(net)
    assert list(net.state_dict()) == list(old_sd)  # nothing to save yet: plain keys
    fc.convert(net, recipe=fc.Float8CurrentScaling())
    assert list(net.state_dict()) == list(old_sd)
    converted = [n for n, m in net.named_modules() if isinstance(m, fc.Linear)]
    fc.convert(net, recipe=fc.DelayedScaling())  # its layout up front
    assert set(net.state_dict()) == set(old_sd) | {f"{n}._extra_state" for n in converted}
    # A checkpoint of the unconverted model loads, strict=True included (the scales
    # start afresh, which a warning says).
    with pytest.warns(UserWarning, match="start afresh"):
        result = net.load_state_dict(old_sd, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []


def test_a_shared_linear_stays_one_module():
    lin = nn.Linear(32, 32)
    seq = nn.Sequential(lin, nn.ReLU(), lin)
    fc.convert(seq)
    assert isinstance(seq[0], fc.Linear)
    assert seq[0] is seq[2]


def test_buffers_registered_on_a_linear_survive():
    lin = nn.Linear(32, 32)
    lin.register_buffer("mask", torch.ones(32, 32))
    seq = nn.Sequential(lin)
    keys = set(seq.state_dict())
    fc.convert(seq)
    assert isinstance(seq[0], fc.Linear)
    assert keys <= set(seq.state_dict())


# -- what convert tells: names, the log ----------------------------------------------------
def _records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "fastcast" and r.levelno == level]


def test_logs_one_info_summary_and_a_debug_line_per_layer(caplog):
    caplog.set_level(logging.DEBUG, logger="fastcast")
    fc.convert(Net())
    (summary,) = _records(caplog, logging.INFO)
    assert summary == (
        "fastcast.convert: converted 6 nn.Linear layer(s) to fastcast.Linear; skipped 2: "
        "blocks.0.odd (out_features=40 not a multiple of 16), "
        "blocks.1.odd (out_features=40 not a multiple of 16)"
    )
    debug = _records(caplog, logging.DEBUG)
    assert len(debug) == 8  # one per layer
    assert "fastcast.convert: blocks.0.proj (in_features=64, out_features=128): converted" in debug
    assert (
        "fastcast.convert: blocks.1.odd (in_features=64, out_features=40): "
        "kept, out_features=40 not a multiple of 16"
    ) in debug


def test_log_gives_every_reason_for_keeping_a_layer(caplog):
    caplog.set_level(logging.INFO, logger="fastcast")
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    model = nn.ModuleDict(
        {
            "mha": mha,
            "odd": nn.Linear(40, 24),
            "a": nn.Linear(64, 64),
            "b": nn.Linear(64, 48),
            "done": fc.Linear(64, 64),
        }
    )
    fc.convert(model, lambda m, fqn: fqn != "a", recipe=fc.MXFP8BlockScaling())
    (summary,) = _records(caplog, logging.INFO)
    assert summary == (
        "fastcast.convert: converted 0 nn.Linear layer(s) to fastcast.Linear; skipped 4: "
        "odd (in_features=40 and out_features=24 not multiples of 32), "
        "a (module_filter_fn returned False), "
        "b (out_features=48 not a multiple of 32), "
        "mha.out_proj (NonDynamicallyQuantizableLinear is a subclass of nn.Linear); "
        "1 already fastcast.Linear"
    )


def test_log_summary_names_ten_skipped_layers_and_counts_the_rest(caplog):
    caplog.set_level(logging.INFO, logger="fastcast")
    fc.convert(nn.Sequential(*[nn.Linear(8, 8) for _ in range(13)], nn.Linear(16, 16)))
    (summary,) = _records(caplog, logging.INFO)
    assert summary.startswith(
        "fastcast.convert: converted 1 nn.Linear layer(s) to fastcast.Linear; skipped 13: "
        "0 (in_features=8 and out_features=8 not multiples of 16), "
    )
    assert "9 (in_features=8" in summary and "10 (" not in summary
    assert summary.endswith(", and 3 more (DEBUG lists them)")


def test_nothing_below_info_is_logged_by_default_and_a_bare_linear_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="fastcast")
    fc.convert(nn.Linear(32, 32))
    assert _records(caplog, logging.INFO) == [
        "fastcast.convert: converted 1 nn.Linear layer(s) to fastcast.Linear; skipped 0"
    ]
    assert _records(caplog, logging.DEBUG) == []


def test_converted_layers_know_their_names_and_errors_quote_them():
    net = fc.convert(Net())  # heads.b (64 -> 48) is 16-aligned, not 32-aligned
    assert net.heads["b"]._fc_name == "heads.b"
    assert net.blocks[1].proj._fc_name == "blocks.1.proj"
    assert fc.convert(nn.Linear(32, 32))._fc_name is None  # no name: shapes in errors
    x = torch.randn(2, 8, 64)
    with fc.autocast(recipe=fc.MXFP8BlockScaling()):
        with pytest.raises(ValueError, match="MXFP8") as info:
            net(x)
    assert str(info.value).startswith(
        "fc.Linear 'heads.b' (in_features=64, out_features=48): MXFP8"
    )


def test_a_shared_linear_is_named_and_logged_once(caplog):
    caplog.set_level(logging.DEBUG, logger="fastcast")
    lin = nn.Linear(32, 32)
    odd = nn.Linear(32, 8)
    seq = nn.Sequential(lin, odd, nn.ReLU(), lin, odd)
    fc.convert(seq)
    assert seq[0] is seq[3] and seq[0]._fc_name == "0"
    assert len(_records(caplog, logging.DEBUG)) == 2
    assert _records(caplog, logging.INFO)[0].endswith(
        "converted 1 nn.Linear layer(s) to fastcast.Linear; skipped 1: "
        "1 (out_features=8 not a multiple of 16)"
    )


# -- end-to-end convergence ----------------------------------------------------------------
STEPS = 30


def _data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 64, generator=g)
    teacher = torch.randn(64, 32, generator=g) / 8
    y = torch.tanh(x @ teacher) + 0.1 * torch.randn(64, 32, generator=g)
    return x, y


def _train(recipe, opt_name):
    """Final loss of a 2-layer MLP (fc.convert of nn.Sequential) after STEPS steps."""
    x, target = _data()
    torch.manual_seed(99)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    if recipe is not None:
        fc.convert(model, recipe=recipe, keep_head=False)  # every layer quantized
        assert isinstance(model[0], fc.Linear) and isinstance(model[2], fc.Linear)
    if opt_name == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        opt.zero_grad()
        with fc.autocast(enabled=recipe is not None, recipe=recipe or fc.DelayedScaling()):
            loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return F.mse_loss(model(x), target).item()  # high precision evaluation


@functools.cache
def _fp32_loss(opt_name):
    return _train(None, opt_name)


CONVERGENCE = {
    "delayed": (fc.DelayedScaling(), 0.05),
    "current": (fc.Float8CurrentScaling(), 0.05),
    "block": (fc.Float8BlockScaling(), 0.05),
    "mxfp8": (fc.MXFP8BlockScaling(), 0.05),
    "rowwise": (fc.Float8RowwiseScaling(), 0.05),
    "rowwise-gw-hp": (fc.Float8RowwiseScaling(wgrad_high_precision=True), 0.05),
    # Not required of FP4, measured to be within ~13% (Adam) here: a looser bound.
    "nvfp4": (fc.NVFP4BlockScaling(), 0.25),
}


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("name", list(CONVERGENCE))
def test_training_converges_like_fp32(name, opt_name):
    recipe, tolerance = CONVERGENCE[name]
    fp32 = _fp32_loss(opt_name)
    x, target = _data()
    assert fp32 < 0.5 * F.mse_loss(torch.zeros_like(target), target).item()  # it learned
    final = isolated(_train, recipe, opt_name)
    assert abs(final - fp32) <= tolerance * fp32, (final, fp32)


def test_strict_load_fills_keys_a_saver_wrote_once_for_tied_tensors():
    """A layer registered twice and a tied parameter appear under two keys; a file that
    has them under one key only (as savers aware of ties write it) loads strictly, and
    each value lands once, in the shared object."""
    recipe = fc.DelayedScaling(amax_history_len=4)

    def build():
        torch.manual_seed(5)
        shared = nn.Linear(32, 32)
        head = nn.Linear(32, 16, bias=False)
        emb = nn.Embedding(16, 32)
        head.weight = emb.weight  # tied
        body = nn.Sequential(shared, nn.ReLU(), shared, head)
        return fc.convert(nn.ModuleDict({"body": body, "emb": emb}), recipe=recipe)

    model = build()
    with fc.autocast(recipe=recipe):
        model["body"](torch.randn(16, 32)).sum().backward()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    assert {"body.0._extra_state", "body.2._extra_state", "body.3.weight"} <= full.keys()
    assert full["body.0._extra_state"].numel() > 16  # delayed scaling's scales
    dropped = ("body.2.", "body.3.weight")
    once = {k: v for k, v in full.items() if not k.startswith(dropped)}
    fresh = build()
    assert fresh.load_state_dict(once).missing_keys == []  # strict
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, full[key]), key
    body = fresh["body"]
    assert body[3].weight is fresh["emb"].weight and body[0] is body[2]
    # A key missing from every one of its names is still reported.
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*"emb.weight"'):
        fresh.load_state_dict({k: v for k, v in once.items() if k != "emb.weight"})
