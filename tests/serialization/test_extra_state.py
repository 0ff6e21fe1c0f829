"""The extra-state format (version 2, a float32 tensor) against its documented layout,
validation of every field before anything is loaded, atomic refusals, the fixtures of
each format version, and loading into a model run with a different recipe.

Expected scales are computed here in float64 from the recorded amaxes (``fmt_max /
amax / 2**margin``), not by fastcast's code. Delayed-scaling runs happen in a fresh
``contextvars.Context`` each (an autocast stack of their own).
"""

from __future__ import annotations

import math
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from _contexts import isolated
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

import fastcast as fc
from fastcast.schemes.delayed import BACKWARD, FORWARD, ScalingMeta, ScalingOrigin
from fastcast.serialization.extra_state import decode_extra_state, encode_extra_state

FIXTURES = Path(__file__).parents[1] / "fixtures" / "extra_state"
MAGIC, HEADER = 0xFCA570, 16
FMT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _steps(model, recipe, steps=3, seed=0, in_features=16):
    gen = torch.Generator().manual_seed(seed)

    def body():
        for i in range(steps):
            x = torch.randn(8, in_features, generator=gen) * (1 + i)
            with fc.autocast(recipe=recipe):
                y = model(x)
            y.pow(2).sum().backward()

    isolated(body)
    return model


def _fixture_model(seed=1):
    """The model the fixtures were saved from (make_v1.py, make_v2.py)."""
    torch.manual_seed(seed)
    return nn.Sequential(fc.Linear(16, 24), nn.ReLU(), fc.Linear(24, 8))


def _snapshot(model):
    """Deep copies of everything a load could change: parameters and extra states."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


# -- the documented layout ----------------------------------------------------------------------
def test_delayed_state_follows_the_documented_layout():
    recipe = fc.DelayedScaling(amax_history_len=4, margin=1, fp8_format=fc.Format.HYBRID)
    lin = _steps(fc.Linear(16, 8), recipe)
    state = lin.get_extra_state()
    assert state.dtype == torch.float32 and state.dim() == 1 and state.device.type == "cpu"
    head = state[:HEADER].tolist()
    # magic, version, kind delayed, header length, L, columns 2 + 1, e4m3 / e5m2, margin 1,
    # amax "max", no custom scale formula, reduce_amax, reserved.
    assert head == [MAGIC, 2, 1, HEADER, 4, 2, 1, 0, 1, 1, 0, 0, 1, 0, 0, 0]
    assert state.numel() == HEADER + 3 + 4 * 3
    scales = state[HEADER : HEADER + 3].double()
    history = state[HEADER + 3 :].reshape(4, 3).double()
    assert history[0].eq(0).all()  # the step being recorded: nothing yet
    # Three steps, L = 4: nothing has left the window, so the last update used them all.
    for col, fmt in enumerate(("e4m3", "e4m3", "e5m2")):
        expected = FMT_MAX[fmt] / history[:, col].max().item() / 2.0
        assert scales[col].item() == pytest.approx(expected, rel=2**-23)
        assert scales[col].item() == torch.tensor(expected, dtype=torch.float32).item()


def test_stateless_modules_store_the_header_alone():
    lin = fc.Linear(32, 32)
    for recipe in (None, fc.Float8CurrentScaling(), fc.MXFP8BlockScaling()):
        if recipe is not None:

            def run(recipe=recipe):
                with fc.autocast(recipe=recipe):
                    lin(torch.randn(32, 32, requires_grad=True)).sum().backward()

            isolated(run)
        state = lin.get_extra_state()
        assert state.tolist() == [MAGIC, 2, 0, HEADER] + [0.0] * (HEADER - 4)
    # Every module gets its own tensor: savers that refuse shared memory accept them.
    assert lin.get_extra_state().data_ptr() != lin.get_extra_state().data_ptr()


def test_read_extra_state_shows_the_recipe_fields():
    recipe = fc.DelayedScaling(amax_history_len=4, fp8_format=fc.Format.E4M3, reduce_amax=False)
    view = fc.read_extra_state(_steps(fc.Linear(16, 8), recipe).get_extra_state())
    assert view["kind"] == "delayed_scaling"
    assert view["forward"]["amax_history"].shape == (4, 2)
    assert view["backward"]["scale"].shape == (1,)
    assert view["backward"]["origin"] == {
        "fmt": "e4m3",
        "margin": 0,
        "amax_compute_algo": "max",
        "custom_scale": False,
        "reduce_amax": False,
    }


origins = st.builds(
    ScalingOrigin,
    st.sampled_from([None, "e4m3", "e5m2"]),
    st.one_of(st.none(), st.integers(0, 40)),
    st.sampled_from([None, "max", "most_recent", "callable"]),
    st.sampled_from([None, True, False]),
    st.sampled_from([None, True, False]),
)
finite_positive = st.floats(min_value=2.0**-126, max_value=2.0**127, width=32)
amaxes = st.floats(min_value=0.0, max_value=2.0**127, width=32)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    directions=st.sampled_from([(FORWARD,), (BACKWARD,), (FORWARD, BACKWARD)]),
    data=st.data(),
)
def test_encode_then_decode_is_the_identity(rows, directions, data):
    columns = {FORWARD: 2, BACKWARD: 1}
    metas = {}
    for d in directions:
        n = columns[d]
        history = torch.tensor(data.draw(st.lists(amaxes, min_size=rows * n, max_size=rows * n)))
        scale = torch.tensor(data.draw(st.lists(finite_positive, min_size=n, max_size=n)))
        origin = data.draw(origins)
        if d == BACKWARD and FORWARD in metas:  # one recipe per module: shared fields
            origin = metas[FORWARD].origin._replace(fmt=origin.fmt)
        metas[d] = ScalingMeta.from_tensors(history.reshape(rows, n), scale, origin)
    decoded = decode_extra_state(encode_extra_state(metas))
    assert decoded.keys() == metas.keys()
    for d, meta in metas.items():
        assert torch.equal(decoded[d].history, meta.history)
        assert torch.equal(decoded[d].scale, meta.scale)
        assert decoded[d].origin == meta.origin


# -- validation: a refused load changes nothing -------------------------------------------------
def _corrupt(state, index, value):
    state = state.clone()
    state[index] = value
    return state


CORRUPTIONS = {
    "nan scale": (lambda s: _corrupt(s, HEADER, math.nan), "scales must be finite and positive"),
    "zero scale": (lambda s: _corrupt(s, HEADER + 1, 0.0), "scales must be finite and positive"),
    "inf scale": (lambda s: _corrupt(s, HEADER + 2, math.inf), "finite and positive"),
    "negative scale": (lambda s: _corrupt(s, HEADER, -2.0), "finite and positive"),
    "nan amax": (lambda s: _corrupt(s, -1, math.nan), "history must be finite and >= 0"),
    "inf amax": (lambda s: _corrupt(s, -2, math.inf), "history must be finite and >= 0"),
    "negative amax": (lambda s: _corrupt(s, -3, -1.0), "history must be finite and >= 0"),
    "other magic": (lambda s: _corrupt(s, 0, 1234.0), "not fastcast's"),
    "newer version": (lambda s: _corrupt(s, 1, 3.0), "unsupported fastcast extra state version"),
    "truncated": (lambda s: s[:-1], "must hold"),
    "one value too many": (lambda s: torch.cat([s, torch.zeros(1)]), "must hold"),
    "header only": (lambda s: s[:HEADER], "must hold"),
    "zero history rows": (lambda s: _corrupt(s, 4, 0.0), "history rows"),
    "three forward columns": (lambda s: _corrupt(s, 5, 3.0), "forward"),
    "unknown format": (lambda s: _corrupt(s, 7, 5.0), "invalid forward format code"),
    "fractional field": (lambda s: _corrupt(s, 9, 0.5), "integers"),
    # A margin no recipe may have: 2.0**1e9 would overflow at the first step after the load.
    "margin 1e9": (lambda s: _corrupt(s, 9, 1e9), r"invalid margin 1000000000 \(header slot 9"),
    "margin past the bound": (lambda s: _corrupt(s, 9, 127.0), "invalid margin 127"),
    "margin below unknown": (lambda s: _corrupt(s, 9, -2.0), "invalid margin -2"),
    "reserved slot": (lambda s: _corrupt(s, 14, 1.0), "reserved header slot 14"),
    "unknown kind": (lambda s: _corrupt(s, 2, 7.0), "unknown fastcast extra state kind"),
    "cast to bfloat16": (lambda s: s.to(torch.bfloat16), "bfloat16"),
    "cast to float64": (lambda s: s.double(), "float64"),
    "two-dimensional": (lambda s: s.reshape(1, -1), "shape"),
    "stateless with data": (
        lambda s: torch.cat([torch.tensor([MAGIC, 2.0, 0.0, HEADER] + [0.0] * 12), s[HEADER:]]),
        "stateless",
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_refused_state_in_the_last_layer_leaves_the_whole_model_unchanged(corruption):
    make, message = CORRUPTIONS[corruption]
    recipe = fc.DelayedScaling(amax_history_len=4)
    source = _steps(fc.convert(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))), recipe)
    target = _steps(fc.convert(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))), recipe, seed=5)
    sd = source.state_dict()
    sd["1._extra_state"] = make(sd["1._extra_state"])
    before = _snapshot(target)
    with pytest.raises(ValueError, match=message) as refused:
        target.load_state_dict(sd)
    assert "'1._extra_state'" in str(refused.value)  # names the entry
    _assert_unchanged(target, before)


def test_a_refused_foreign_pickle_leaves_earlier_layers_unchanged():
    model = fc.convert(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))
    sd = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    sd.update({k: v - 1 for k, v in sd.items() if k.endswith("_extra_state")})
    sd["2._extra_state"] = torch.frombuffer(bytearray(b"\x80\x04N."), dtype=torch.uint8)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="refusing a pickled extra state"):
        model.load_state_dict(sd)
    _assert_unchanged(model, before)


def test_a_bare_fc_linear_refuses_before_writing_its_weight():
    lin = _steps(fc.Linear(16, 8), fc.DelayedScaling(amax_history_len=4))
    sd = {k: v.clone() for k, v in lin.state_dict().items()}
    sd["weight"] += 1
    sd["_extra_state"][HEADER] = math.nan
    before = _snapshot(lin)
    with pytest.raises(ValueError, match="finite and positive"):
        lin.load_state_dict(sd)
    _assert_unchanged(lin, before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["forward"].update(scale=torch.tensor([math.nan, 1.0])), "finite"),
        (lambda s: s["forward"].update(scale=torch.tensor([0.0, 1.0])), "positive"),
        (lambda s: s["backward"].update(amax_history=torch.zeros(0, 1)), "shapes"),
        (lambda s: s["backward"].update(amax_history=torch.zeros(8, 2)), "shapes"),
        (lambda s: s["forward"].update(extra=torch.ones(1)), "exactly the tensors"),
        (lambda s: s.update(surprise=1), "unknown keys"),
        (lambda s: s.update(version=7), "unsupported"),
    ],
)
def test_version_1_state_is_validated_too(change, message):
    sd = torch.load(FIXTURES / "v1_delayed.pt", weights_only=True)
    change(sd["2._extra_state"])
    model = fc.convert(_fixture_model())
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message):
        model.load_state_dict(sd)
    _assert_unchanged(model, before)


# -- fixtures of every format version ------------------------------------------------------------
def _expected_first_scale(history, fmt):
    """What a state of unknown origin gets when it first runs: fmt_max over the largest
    amax of its history (float64, rounded once to float32)."""
    amax = history.double().max(dim=0).values
    return torch.where(amax > 0, FMT_MAX[fmt] / amax, 1.0).float()


def test_version_1_fixtures_load(tmp_path):
    stateless = _fixture_model()
    stateless.load_state_dict(torch.load(FIXTURES / "v1_stateless.pt", weights_only=True))
    assert fc.read_extra_state(stateless[0].get_extra_state()) == {"kind": "stateless"}

    raw = torch.load(FIXTURES / "v1_delayed.pt", weights_only=True, mmap=True)
    model = _fixture_model(seed=7)
    model.load_state_dict(raw, strict=True)
    for i in (0, 2):
        view = fc.read_extra_state(model[i].get_extra_state())
        for name in ("forward", "backward"):
            assert torch.equal(
                view[name]["amax_history"], raw[f"{i}._extra_state"][name]["amax_history"]
            )
            assert torch.equal(view[name]["scale"], raw[f"{i}._extra_state"][name]["scale"])
            assert set(view[name]["origin"].values()) == {None}  # version 1 had no recipe
    assert torch.equal(model[0].weight, raw["0.weight"])

    # Origin unknown: the first run refits the scales to its recipe from the history.
    recipe = fc.DelayedScaling(amax_history_len=8)
    history = raw["0._extra_state"]["backward"]["amax_history"]

    def forward():
        with fc.autocast(recipe=recipe):
            model(torch.randn(8, 16))

    isolated(forward)
    bwd_scale = model[0]._scheme_state[BACKWARD].scale
    assert torch.equal(bwd_scale, _expected_first_scale(history, "e5m2"))

    whole = torch.load(FIXTURES / "v1_model.pt", weights_only=False)
    for i in (0, 2):
        assert torch.equal(
            whole[i]._scheme_state[FORWARD].history,
            raw[f"{i}._extra_state"]["forward"]["amax_history"],
        )


def test_version_2_fixtures_load_and_save_back_bit_for_bit():
    stateless = _fixture_model(seed=3)
    stateless.load_state_dict(load_file(FIXTURES / "v2_stateless.safetensors"))
    assert fc.read_extra_state(stateless[2].get_extra_state()) == {"kind": "stateless"}

    raw = load_file(FIXTURES / "v2_delayed.safetensors")
    model = _fixture_model(seed=3)
    model.load_state_dict(raw, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, raw[key]), key
    pt = torch.load(FIXTURES / "v2_delayed.pt", weights_only=True, mmap=True)
    assert pt.keys() == raw.keys() and all(torch.equal(pt[k], raw[k]) for k in raw)

    # Same recipe as saved: the scales go on unchanged (the origin matches).
    before = model[0]._scheme_state[FORWARD].scale.clone()

    def forward():
        with torch.no_grad(), fc.autocast(recipe=fc.DelayedScaling(amax_history_len=8)):
            model(torch.randn(8, 16))

    isolated(forward)
    assert torch.equal(model[0]._scheme_state[FORWARD].scale, before)


# -- a different recipe or history length -------------------------------------------------------
def _trained_state(recipe):
    lin = _steps(fc.Linear(16, 8), recipe, steps=5)
    return lin.state_dict(), {
        d: (m.history.clone(), m.scale.clone()) for d, m in lin._scheme_state.items()
    }


def _first_forward(lin, recipe):
    def run():
        with torch.no_grad(), fc.autocast(recipe=recipe):
            lin(torch.randn(8, 16))

    isolated(run)


@pytest.mark.parametrize("new_len", [1, 3, 8, 12])
def test_another_history_length_keeps_the_newest_amaxes(new_len):
    sd, saved = _trained_state(fc.DelayedScaling(amax_history_len=8))
    lin = fc.Linear(16, 8)
    lin.load_state_dict(sd)
    _first_forward(lin, fc.DelayedScaling(amax_history_len=new_len))
    for d, (history, scale) in saved.items():
        new = lin._scheme_state[d].history
        assert new.shape == (new_len, history.shape[1])
        past = min(new_len, 8) - 1
        if past:  # rows 1.. are oldest first: the newest `past` rows end both histories
            assert torch.equal(new[new_len - past :], history[8 - past :])
        assert new[1 : new_len - past].eq(0).all()
        assert torch.equal(lin._scheme_state[d].scale, scale)  # same format and margin


def test_another_format_or_margin_refits_the_scales_from_the_history():
    sd, saved = _trained_state(fc.DelayedScaling(amax_history_len=8))  # HYBRID: e5m2 grads
    lin = fc.Linear(16, 8)
    lin.load_state_dict(sd)
    _first_forward(lin, fc.DelayedScaling(amax_history_len=8, fp8_format=fc.Format.E4M3, margin=2))
    for d, fmt in ((FORWARD, "e4m3"), (BACKWARD, "e4m3")):
        amax = saved[d][0].double().max(dim=0).values
        expected = (FMT_MAX[fmt] / 4 / amax).float()
        assert torch.equal(lin._scheme_state[d].scale, expected)
    # Before the refit the gradient scale was e5m2's, 128x too large for e4m3.
    assert (saved[BACKWARD][1] / lin._scheme_state[BACKWARD].scale).item() == pytest.approx(512.0)


def test_a_plain_checkpoint_starts_the_scales_afresh():
    lin = _steps(fc.Linear(16, 8), fc.DelayedScaling(amax_history_len=4))
    plain = nn.Linear(16, 8)
    assert lin.load_state_dict(plain.state_dict(), strict=True).missing_keys == []
    for meta in lin._scheme_state.values():
        assert meta.history.eq(0).all() and meta.scale.eq(1).all()
    assert torch.equal(lin.weight, plain.weight)


@settings(max_examples=80, deadline=None)
@given(old_len=st.integers(1, 10), new_len=st.integers(1, 10), n=st.integers(1, 3), data=st.data())
def test_resize_history_keeps_row_zero_and_the_newest_rows(old_len, new_len, n, data):
    values = data.draw(st.lists(st.integers(0, 1000), min_size=old_len * n, max_size=old_len * n))
    rows = [values[i * n : (i + 1) * n] for i in range(old_len)]
    meta = ScalingMeta.from_tensors(torch.tensor(rows, dtype=torch.float32), torch.ones(n))
    meta.resize_history(new_len)
    # Model: row 0 stays; the past rows (oldest first) keep their newest new_len - 1.
    past = rows[1:][max(0, old_len - new_len) :] if new_len > 1 else []
    expected = [rows[0]] + [[0] * n] * (new_len - 1 - len(past)) + past
    assert meta.history.tolist() == expected


# -- strip and models built on the meta device --------------------------------------------------
def test_strip_extra_state_removes_only_fastcasts_entries():
    model = _steps(
        fc.convert(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))),
        fc.DelayedScaling(amax_history_len=4),
    )
    sd = model.state_dict()
    sd["custom._extra_state"] = torch.arange(3)  # someone else's extra state: kept
    stripped = fc.strip_extra_state(sd)
    assert list(stripped) == [k for k in sd if k != "0._extra_state"]
    assert stripped._metadata is sd._metadata
    plain = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    del stripped["custom._extra_state"]
    plain.load_state_dict(stripped, strict=True)
    assert torch.equal(plain[0].weight, model[0].weight)


def test_a_model_built_on_the_meta_device_loads_its_state():
    source = _steps(fc.Linear(16, 16), fc.DelayedScaling(amax_history_len=4))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16))
    fc.convert(model, recipe=fc.DelayedScaling(amax_history_len=4))
    assert model[0].get_extra_state().numel() == HEADER + 3 + 4 * 3  # layout known already
    model.to_empty(device="cpu")
    model.load_state_dict({f"0.{k}": v for k, v in source.state_dict().items()})
    assert torch.equal(model[0].get_extra_state(), source.get_extra_state())


def test_a_model_that_does_not_run_keeps_its_window_while_another_steps():
    """Two models under equal recipes in one thread share slabs; stepping one must not
    age the other's amax history (nor move its scales once an amax leaves the window)."""
    recipe = fc.DelayedScaling(amax_history_len=4)

    def step(model, value):
        def run():
            x = torch.full((16, 16), value, requires_grad=True)
            with fc.autocast(recipe=recipe):
                y = model(x)
            y.sum().backward()

        isolated(run)

    a = fc.Linear(16, 16)
    step(a, 8.0)
    step(a, 1.0)
    b = fc.Linear(16, 16)
    step(b, 1.0)
    assert a._scheme_state[FORWARD].slab is b._scheme_state[FORWARD].slab  # the case under test
    before = {d: (m.history.clone(), m.scale.clone()) for d, m in a._scheme_state.items()}
    assert before[FORWARD][1][0].item() == 448.0 / 8.0
    for _ in range(4):
        step(b, 1.0)
    for d, (history, scale) in before.items():
        assert torch.equal(a._scheme_state[d].history, history)
        assert torch.equal(a._scheme_state[d].scale, scale)


def test_state_the_format_cannot_hold_is_an_error_not_dropped():
    """A third-party scheme that keeps per-module state in ``module_state`` (the module's
    ``_scheme_state``) cannot be saved by this format: saving says so."""
    lin = fc.Linear(16, 16)
    lin._scheme_state["my_scheme"] = torch.ones(3)
    with pytest.raises(ValueError, match="does not know"):
        lin.state_dict()


@pytest.mark.parametrize("version", [1, 2])
def test_a_stride_0_state_in_a_weights_only_file_is_refused_before_copying(version, tmp_path):
    """A few kB of file whose extra state claims 67M history rows through a stride-0
    view: refused from what the storage holds, before anything is copied."""
    rows = 1 << 26
    lin = _steps(fc.Linear(16, 8), fc.DelayedScaling(amax_history_len=4))
    sd = {k: v.clone() for k, v in lin.state_dict().items()}
    if version == 2:
        sd["_extra_state"] = torch.ones(1).expand(HEADER + 3 + rows * 3)  # 1 value held
    else:
        sd["_extra_state"] = {
            "format": "fastcast.extra_state",
            "version": 1,
            "kind": "delayed_scaling",
            "forward": {"amax_history": torch.ones(1).expand(rows, 2), "scale": torch.ones(2)},
        }
    torch.save(sd, tmp_path / "small.pt")
    assert (tmp_path / "small.pt").stat().st_size < 8 << 10
    loaded = torch.load(tmp_path / "small.pt", weights_only=True)
    before = _snapshot(lin)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=r"'_extra_state'.*storage holds 1\b"):
            lin.load_state_dict(loaded)
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < 5 and peak < 100 << 20
    _assert_unchanged(lin, before)


@pytest.mark.parametrize("history_len", [1, 4])
def test_resuming_under_another_format_never_applies_the_saved_gradient_scale(history_len):
    """Saved under HYBRID (e5m2 gradients), resumed under E4M3: the first step's weight
    gradient is as accurate as a fresh module's, against a float64 reference. With
    ``amax_history_len=1`` the saved history holds no amax to recompute from; the e5m2
    scale (~128x too large for e4m3) used to be kept and flushed most of the gradient."""
    torch.manual_seed(0)
    saved = fc.Linear(64, 32)
    hybrid = fc.DelayedScaling(fp8_format=fc.Format.HYBRID, amax_history_len=history_len)
    e4m3 = fc.DelayedScaling(fp8_format=fc.Format.E4M3, amax_history_len=history_len)
    gen = torch.Generator().manual_seed(1)
    grad_scale = 1e-3  # small gradients: where an e5m2 scale is far off for e4m3

    def step(lin, recipe, x):
        with fc.autocast(recipe=recipe):
            y = lin(x)
        (y * grad_scale).sum().backward()
        return y

    for _ in range(3):
        isolated(step, saved, hybrid, torch.randn(16, 64, generator=gen))
    sd = saved.state_dict()
    assert fc.read_extra_state(sd["_extra_state"])["backward"]["origin"]["fmt"] == "e5m2"

    x = torch.randn(16, 64, generator=gen)
    resumed = fc.Linear(64, 32)
    resumed.load_state_dict(sd)
    isolated(step, resumed, e4m3, x)
    # float64 reference: dW = grad_scale * sum over tokens of x (the output gradient is
    # grad_scale everywhere).
    reference = (grad_scale * torch.ones(16, 32, dtype=torch.float64)).T @ x.double()
    error = (resumed.weight.grad.double() - reference).norm() / reference.norm()
    assert error < 0.1, error.item()  # 0.99 with the e5m2 scale kept
    view = fc.read_extra_state(resumed.get_extra_state())
    assert view["backward"]["origin"]["fmt"] == "e4m3"
    if history_len == 1:
        # The step ran with the scale e4m3 gives the amax the saved e5m2 scale stood
        # for: 448 / (57344 / saved), computed here in float64.
        saved_scale = fc.read_extra_state(sd["_extra_state"])["backward"]["scale"]
        expected = (saved_scale.double() * 448.0 / 57344.0).float()
        used = isolated(_scale_used_by_first_backward, sd, e4m3)
        assert torch.equal(used, expected)


def _scale_used_by_first_backward(sd, recipe):
    """The gradient scale a module loaded from ``sd`` quantizes its first backward with
    (read right after its first forward, before the backward updates it)."""
    lin = fc.Linear(64, 32)
    lin.load_state_dict(sd)
    with fc.autocast(recipe=recipe):
        lin(torch.randn(4, 64))
    return fc.read_extra_state(lin.get_extra_state())["backward"]["scale"]
