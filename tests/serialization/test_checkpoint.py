"""Checkpoints: fastcast's own extra state (plain tensors, loadable with weights_only and
mmap), foreign pickled extra state (refused unread, or unpickled inside
``fc.allow_unsafe_extra_state()`` and converted from TransformerEngine's layout), and
state dicts moving between ``nn.Linear`` and ``fc.Linear``.

Delayed-scaling runs happen in a fresh ``contextvars.Context`` each (an autocast stack
of their own). Loading happens in the test's own context: the opt-in belongs to the
context that enters it.
"""

from __future__ import annotations

import io
import pickle
import sys
import threading
import types

import pytest
import torch
from _contexts import isolated
from hypothesis import given, settings
from hypothesis import strategies as st
from test_extra_state import _steps
from torch import nn

import fastcast as fc
from fastcast.runtime import state as fc_state

pytestmark = pytest.mark.usefixtures("single_thread")

RECIPE = fc.DelayedScaling(amax_history_len=8)


def _train(model, steps=3, seed=0):
    """A few delayed-scaling steps (``test_extra_state._steps``, this file's recipe)."""
    return _steps(model, RECIPE, steps=steps, seed=seed)


def _step(model, x, recipe=RECIPE):
    """One training step on a copy-free model: output, input grad and parameter grads."""

    def body():
        model.zero_grad(set_to_none=True)
        x_ = x.clone().requires_grad_(True)
        with fc.autocast(recipe=recipe):
            y = model(x_)
        y.pow(2).sum().backward()
        return y.detach(), x_.grad, [p.grad for p in model.parameters()]

    return isolated(body)


def _assert_same_step(a, b):
    (ya, xa, pa), (yb, xb, pb) = a, b
    assert torch.equal(ya, yb) and torch.equal(xa, xb)
    assert len(pa) == len(pb) and all(torch.equal(u, v) for u, v in zip(pa, pb))


def _model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(fc.Linear(16, 24), nn.ReLU(), fc.Linear(24, 8))


# -- fastcast's own state -------------------------------------------------------------------
def test_delayed_state_round_trips_through_weights_only_mmap_load(tmp_path):
    model = _train(_model())
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    loaded = torch.load(path, weights_only=True, mmap=True)
    assert all(v.dtype == torch.float32 for k, v in loaded.items() if k.endswith("_extra_state"))
    fresh = _model(seed=2)
    assert fresh.load_state_dict(loaded).missing_keys == []
    for i in (0, 2):
        for d in (0, 1):
            assert torch.equal(fresh[i]._scheme_state[d].scale, model[i]._scheme_state[d].scale)
            assert torch.equal(fresh[i]._scheme_state[d].history, model[i]._scheme_state[d].history)
        assert not torch.equal(fresh[i]._scheme_state[0].scale, torch.ones(2))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(9)) * 5
    _assert_same_step(_step(fresh, x), _step(model, x))


def test_stateless_recipe_saves_a_plain_state_dict(tmp_path):
    model = _model()
    x = torch.randn(8, 16)
    _step(model, x, recipe=fc.Float8CurrentScaling())
    sd = model.state_dict()
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    assert {k: (v.shape, v.dtype) for k, v in sd.items()} == {
        k: (v.shape, v.dtype) for k, v in plain.state_dict().items()
    }
    path = tmp_path / "stateless.pt"
    torch.save(sd, path)
    fresh = _model(seed=3)
    fresh.load_state_dict(torch.load(path, weights_only=True, mmap=True))
    assert fresh[0]._scheme_state == {}
    assert torch.equal(fresh[0].weight, model[0].weight)
    plain.load_state_dict(torch.load(path, weights_only=True, mmap=True))  # strict


def test_nn_linear_and_fc_linear_state_dicts_load_into_each_other():
    torch.manual_seed(4)
    plain = nn.Linear(16, 8)
    ours = fc.Linear(16, 8)
    result = ours.load_state_dict(plain.state_dict(), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(ours.weight, plain.weight) and torch.equal(ours.bias, plain.bias)
    assert fc.read_extra_state(ours.get_extra_state())["kind"] == "stateless"

    trained = _train(fc.Linear(16, 8), seed=5)
    back = nn.Linear(16, 8)
    result = back.load_state_dict(trained.state_dict(), strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["_extra_state"]  # delayed
    assert torch.equal(back.weight, trained.weight) and torch.equal(back.bias, trained.bias)
    result = nn.Linear(16, 8).load_state_dict(fc.strip_extra_state(trained.state_dict()))
    assert result.missing_keys == [] and result.unexpected_keys == []


# -- foreign pickles: refused unread ------------------------------------------------------------
SIDE_EFFECTS: list[str] = []


class _Payload:
    """Stands in for ``os.system``: constructing it is the side effect."""

    def __init__(self, command):
        SIDE_EFFECTS.append(command)


class _Exploit:
    def __reduce__(self):
        return (_Payload, ("os.system('rm -rf ~')",))


def _as_payload(obj, form):
    """``obj`` pickled the way a foreign library would store it as extra state."""
    if form == "torch.save-bytesio":  # TransformerEngine 1.x
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf
    data = pickle.dumps(obj)
    if form == "pickle-uint8":  # TransformerEngine 2.x
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if form == "pickle-bytes":
        return data
    raise AssertionError(form)


FORMS = ["torch.save-bytesio", "pickle-uint8", "pickle-bytes"]


def _load_extra(module, payload):
    sd = module.state_dict()
    sd["_extra_state"] = payload
    return module.load_state_dict(sd)


@pytest.mark.parametrize("form", FORMS)
def test_malicious_pickle_is_refused_without_running_it(form):
    SIDE_EFFECTS.clear()
    payload = _as_payload({"scale_fwd": _Exploit()}, form)
    lin = fc.Linear(16, 8)
    with pytest.raises(ValueError, match="refusing a pickled extra state") as info:
        _load_extra(lin, payload)
    message = str(info.value)
    assert "_Payload" in message  # what it would have imported
    assert "fc.allow_unsafe_extra_state()" in message
    assert SIDE_EFFECTS == []
    assert fc.read_extra_state(lin.get_extra_state())["kind"] == "stateless"
    # The opt-in runs only a restricted unpickler, which refuses the global unimported.
    with fc.allow_unsafe_extra_state(), pytest.raises(ValueError, match="_Payload"):
        _load_extra(lin, payload)
    assert SIDE_EFFECTS == []


def _started_afresh(lin):
    """Whether ``lin`` keeps delayed-scaling state with every scale 1 and no amax yet."""
    view = fc.read_extra_state(lin.get_extra_state())
    return view["kind"] == "delayed_scaling" and all(
        torch.equal(view[d]["scale"], torch.ones_like(view[d]["scale"]))
        and not view[d]["amax_history"].any()
        for d in ("forward", "backward")
    )


@pytest.mark.filterwarnings("ignore:fastcast. the checkpoint holds no per-layer state")
def test_empty_payload_means_no_state():
    """An empty payload holds no state, as an absent entry: a layer that keeps state (and
    whose weight is loaded) starts its scales afresh."""
    for payload in (
        lambda: torch.empty(0, dtype=torch.uint8),  # TransformerEngine: "no FP8 state"
        io.BytesIO,
        lambda: _as_payload(None, "torch.save-bytesio"),  # older TE, no FP8 state
    ):
        lin = _train(fc.Linear(16, 8))
        assert not _started_afresh(lin)
        with fc.allow_unsafe_extra_state():
            _load_extra(lin, payload())
        assert _started_afresh(lin)
    stateless = fc.Linear(16, 8)
    _load_extra(stateless, torch.empty(0, dtype=torch.uint8))
    assert stateless._scheme_state == {} and "_extra_state" not in stateless.state_dict()


# -- foreign pickles: TransformerEngine's delayed-scaling state ------------------------------
HISTORY_LEN = 4
TE_MODULE = "transformer_engine.common.recipe"
_TE_TENSORS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


def _te_recipe():
    """An object that pickles as TransformerEngine's recipe class (not installed here)."""
    cls = type("DelayedScaling", (), {"__module__": TE_MODULE})
    recipe = cls()
    recipe.margin, recipe.amax_history_len = 0, HISTORY_LEN
    return recipe


def _te_pickle(state, form):
    """Pickle ``state`` while a fake ``transformer_engine`` is importable, then remove it."""
    names = ["transformer_engine", "transformer_engine.common", TE_MODULE]
    assert not any(n in sys.modules for n in names)
    modules = {n: types.ModuleType(n) for n in names}
    recipe = state.get("recipe")
    if recipe is not None:
        modules[TE_MODULE].DelayedScaling = type(recipe)
    sys.modules.update(modules)
    try:
        return _as_payload(state, form)
    finally:
        for n in names:
            del sys.modules[n]


def _te_state(**changes):
    state = {
        "recipe": _te_recipe(),
        # columns: input, weight, output
        "scale_fwd": torch.tensor([3.0, 5.0, 7.0]),
        "amax_history_fwd": torch.arange(HISTORY_LEN * 3, dtype=torch.float32).view(-1, 3) + 1,
        # columns: grad_output, grad_input
        "scale_bwd": torch.tensor([1.0 / 3.0, 13.0]),
        "amax_history_bwd": torch.arange(HISTORY_LEN * 2, dtype=torch.float32).view(-1, 2) + 50,
        "extra_fp8_variables": {
            "num_gemms": 1,
            "fp8_checkpoint": True,
            "fp8_max_fwd": 448.0,
            "fp8_max_bwd": 57344.0,
        },
    }
    state.update(changes)
    return {k: v for k, v in state.items() if v is not None}


def _own_state(fwd_scale, fwd_history, bwd_scale, bwd_history):
    return {
        "format": "fastcast.extra_state",
        "version": 1,
        "kind": "delayed_scaling",
        "forward": {"amax_history": fwd_history, "scale": fwd_scale},
        "backward": {"amax_history": bwd_history, "scale": bwd_scale},
    }


@pytest.mark.parametrize("form", FORMS)
def test_transformer_engine_state_loads_inside_the_opt_in(form, tmp_path):
    te = _te_state()
    payload = _te_pickle(te, form)
    torch.manual_seed(6)
    lin = fc.Linear(16, 8)
    sd = lin.state_dict()
    sd["_extra_state"] = payload
    if form == "pickle-uint8":  # a TE 2.x checkpoint itself loads with weights_only=True
        torch.save(sd, tmp_path / "te.pt")
        sd = torch.load(tmp_path / "te.pt", weights_only=True, mmap=True)
    with pytest.raises(ValueError, match=rf"{TE_MODULE}\.DelayedScaling"):
        lin.load_state_dict(sd)
    with fc.allow_unsafe_extra_state():
        lin.load_state_dict(sd)

    fwd, bwd = lin._scheme_state[0], lin._scheme_state[1]
    assert torch.equal(fwd.scale, torch.tensor([3.0, 5.0]))  # input, weight
    assert torch.equal(fwd.history, te["amax_history_fwd"][:, :2])
    assert torch.equal(bwd.scale, torch.tensor([1.0 / 3.0]))  # grad_output
    assert torch.equal(bwd.history, te["amax_history_bwd"][:, :1])
    assert fwd.scale.dtype == bwd.history.dtype == torch.float32

    # It runs with those scales: exactly like a module given them in fastcast's format,
    # and not like one starting from scale 1.
    same = fc.Linear(16, 8)
    same.load_state_dict(lin.state_dict())
    reference = fc.Linear(16, 8)
    reference.load_state_dict(
        {
            "weight": lin.weight,
            "bias": lin.bias,
            "_extra_state": _own_state(
                torch.tensor([3.0, 5.0]),
                te["amax_history_fwd"][:, :2].clone(),
                torch.tensor([1.0 / 3.0]),
                te["amax_history_bwd"][:, :1].clone(),
            ),
        }
    )
    fresh = fc.Linear(16, 8)
    fresh.load_state_dict({"weight": lin.weight, "bias": lin.bias}, strict=False)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    step = _step(lin, x)
    assert all(torch.isfinite(t).all() for t in (step[0], step[1], *step[2]))
    _assert_same_step(step, _step(reference, x))
    _assert_same_step(step, _step(same, x))
    assert not torch.equal(step[0], _step(fresh, x)[0])


def test_own_state_pickled_loads_inside_the_opt_in():
    source = _train(fc.Linear(16, 8))
    payload = _as_payload(source.get_extra_state(), "torch.save-bytesio")
    target = fc.Linear(16, 8)
    with pytest.raises(ValueError, match="refusing"):
        _load_extra(target, payload)
    with fc.allow_unsafe_extra_state():
        _load_extra(target, payload)
    for d in (0, 1):
        assert torch.equal(target._scheme_state[d].scale, source._scheme_state[d].scale)
        assert torch.equal(target._scheme_state[d].history, source._scheme_state[d].history)


@pytest.mark.filterwarnings("ignore:fastcast. the checkpoint holds no per-layer state")
def test_transformer_engine_state_without_scales_is_stateless():
    # A TE recipe without delayed scaling pickles only the recipe and the bookkeeping:
    # no state, as an absent entry.
    payload = _te_pickle(_te_state(**dict.fromkeys(_TE_TENSORS)), "pickle-uint8")
    lin = _train(fc.Linear(16, 8))
    with fc.allow_unsafe_extra_state():
        _load_extra(lin, payload)
    assert _started_afresh(lin)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"mystery_state": torch.ones(3)}, "mystery_state"),
        ({"amax_history_fwd": None}, r"amax_history_fwd \[L, 3\].*'scale_fwd': tensor \[3\]"),
        (  # LayerNormMLP: two GEMMs
            {"scale_fwd": torch.ones(6), "amax_history_fwd": torch.zeros(HISTORY_LEN, 6)},
            r"'scale_fwd': tensor \[6\] float32",
        ),
        ({"extra_fp8_variables": {"num_gemms": 2}}, "2 GEMMs"),
        ({"scale_bwd": torch.ones(2, dtype=torch.int32)}, "'scale_bwd': tensor \\[2\\] int32"),
        ({"scale_inv_fwd": torch.ones(2)}, "scale_inv_fwd"),
        ({"extra_fp8_variables": [1]}, "extra_fp8_variables"),
    ],
    ids=["unknown-key", "missing-history", "two-gemms", "num-gemms", "int-scale", "inv", "extra"],
)
def test_unexpected_transformer_engine_state_is_an_error(changes, match):
    payload = _te_pickle(_te_state(**changes), "pickle-bytes")
    lin = _train(fc.Linear(16, 8))
    before = lin._scheme_state[0].scale.clone()
    with fc.allow_unsafe_extra_state(), pytest.raises(ValueError, match=match):
        _load_extra(lin, payload)
    assert torch.equal(lin._scheme_state[0].scale, before)  # nothing half-loaded


def test_scale_inv_is_accepted_and_left_behind():
    te = _te_state(scale_inv_fwd=1 / torch.tensor([3.0, 5.0, 7.0]), scale_inv_bwd=torch.ones(2))
    lin = fc.Linear(16, 8)
    with fc.allow_unsafe_extra_state():
        _load_extra(lin, _te_pickle(te, "pickle-bytes"))
    assert torch.equal(lin._scheme_state[0].scale, torch.tensor([3.0, 5.0]))


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({"foo": 1}, "neither fastcast's nor TransformerEngine's: {'foo': int}"),
        ([1, 2], "builtins.list"),
        ({}, "an empty dict"),
    ],
)
def test_other_unpickled_objects_are_errors(obj, match):
    lin = fc.Linear(16, 8)
    with fc.allow_unsafe_extra_state(), pytest.raises(ValueError, match=match):
        _load_extra(lin, _as_payload(obj, "pickle-bytes"))


# -- the opt-in: per thread, nested, restored -------------------------------------------------
def _te_payload():
    return _te_pickle(_te_state(), "pickle-uint8")


def _allowed():
    return fc_state.unsafe_extra_state_allowed()


def test_opt_in_nests_and_reenters():
    payload = _te_payload()
    lin = fc.Linear(16, 8)
    cm = fc.allow_unsafe_extra_state()
    assert not hasattr(cm, "__dict__")
    with cm as entered:
        assert entered is cm
        with cm:
            with fc.allow_unsafe_extra_state():
                _load_extra(lin, payload)
            _load_extra(lin, payload)
        _load_extra(lin, payload)  # the outer level still allows
        assert _allowed()
    assert not _allowed()
    with pytest.raises(ValueError, match="refusing"):
        _load_extra(lin, payload)


def test_opt_in_is_restored_after_exceptions():
    lin = fc.Linear(16, 8)
    with pytest.raises(RuntimeError, match="boom"), fc.allow_unsafe_extra_state():
        raise RuntimeError("boom")
    assert not _allowed()
    bad = _te_pickle(_te_state(mystery=1), "pickle-bytes")
    with pytest.raises(ValueError, match="mystery"), fc.allow_unsafe_extra_state():
        _load_extra(lin, bad)
    assert not _allowed()
    with pytest.raises(ValueError, match="refusing"):
        _load_extra(lin, _te_payload())


def test_opt_in_is_per_thread():
    payload = _te_payload()
    lin = fc.Linear(16, 8)
    inside, release = threading.Event(), threading.Event()
    results = {}

    def other_thread_inside():
        with fc.allow_unsafe_extra_state():
            inside.set()
            release.wait(30)
            mine = fc.Linear(16, 8)
            _load_extra(mine, payload)  # allowed here
            results["other"] = mine._scheme_state[0].scale.clone()

    thread = threading.Thread(target=other_thread_inside)
    thread.start()
    try:
        assert inside.wait(30)
        with pytest.raises(ValueError, match="refusing"):
            _load_extra(lin, payload)  # this thread has not opted in
    finally:
        release.set()
        thread.join(30)
    assert torch.equal(results["other"], torch.tensor([3.0, 5.0]))

    def other_thread_outside():
        try:
            _load_extra(fc.Linear(16, 8), payload)
        except ValueError as exc:
            results["refused"] = str(exc)

    with fc.allow_unsafe_extra_state():
        thread = threading.Thread(target=other_thread_outside)
        thread.start()
        thread.join(30)
        _load_extra(lin, payload)  # while this one has
    assert "refusing" in results["refused"]
    assert torch.equal(lin._scheme_state[0].scale, torch.tensor([3.0, 5.0]))


# -- a refused load changes nothing, however the model was built ------------------------------
class _Block(nn.Module):
    """A model class that builds its fc.Linear layers itself (as a library's would)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.layers = nn.ModuleList([fc.Linear(16, 16) for _ in range(2)])
        self.heads = nn.ModuleDict({"out": nn.Sequential(nn.ReLU(), fc.Linear(16, 8))})

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x)
        return self.heads["out"](x)


BUILDS = {
    "sequential": lambda: nn.Sequential(fc.Linear(16, 24), nn.ReLU(), fc.Linear(24, 8)),
    "model class": _Block,
    "nested": lambda: nn.Sequential(nn.Sequential(_Block()), nn.Linear(8, 8)),
    "converted": lambda: fc.convert(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))),
}


def _built(build, seed):
    torch.manual_seed(seed)
    return _train(BUILDS[build](), seed=seed)


def _last_extra_key(model):
    return [k for k in model.state_dict() if k.endswith("_extra_state")][-1]


def _snapshot_all(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bytewise_unchanged(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    changed = [
        k
        for k in before
        if not torch.equal(
            after[k].view(-1).view(torch.uint8), before[k].view(-1).view(torch.uint8)
        )
    ]
    assert changed == []


def _nan_scale(state):
    state = state.clone()
    state[16] = float("nan")  # the first forward scale
    return state


def _zero_columns(state):
    """A version 1 state whose forward part has no columns."""
    return {
        "format": "fastcast.extra_state",
        "version": 1,
        "kind": "delayed_scaling",
        "forward": {"amax_history": torch.zeros(4, 0), "scale": torch.zeros(0)},
    }


# Each unreadable form names the module's entry and says what is wrong (these were
# NotImplementedError/RuntimeError from deep in torch).
UNREADABLE = {
    "meta": (lambda s: s.to("meta"), "meta device"),
    "sparse": (lambda s: s.to_sparse(), "sparse_coo tensor"),
    "nested": (lambda s: torch.nested.nested_tensor([s, s]), "nested tensor"),
    "zero columns": (_zero_columns, "forward delayed-scaling state has 0 columns"),
    "nan scale": (_nan_scale, "finite and positive"),
}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("form", list(UNREADABLE))
@pytest.mark.parametrize("build", list(BUILDS))
def test_a_refused_extra_state_changes_nothing_however_the_model_was_built(build, form, strict):
    make, message = UNREADABLE[form]
    source, target = _built(build, seed=0), _built(build, seed=5)
    sd = source.state_dict()
    key = _last_extra_key(target)
    sd[key] = make(sd[key])
    before = _snapshot_all(target)
    with pytest.raises(ValueError, match=message) as refused:
        target.load_state_dict(sd, strict=strict)
    assert f"at {key!r}" in str(refused.value)  # names the module's entry
    _assert_bytewise_unchanged(target, before)
    # The same model then loads the good state dict (nothing was left half-checked).
    target.load_state_dict(source.state_dict(), strict=strict)
    assert _snapshot_all(target).keys() == before.keys()
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in _snapshot_all(target).items())


def test_a_layer_added_to_a_built_model_guards_its_parent():
    """Registration climbs from the inside out: an fc.Linear assigned into a model already
    built makes its new parent refuse atomically (fc.convert(model) guards the rest)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.ReLU()))
    model[1].add_module("1", fc.Linear(16, 8))
    model[1].add_module("2", fc.Linear(8, 8))
    _train(model)
    sd = {k: v + 1 if not k.endswith("_extra_state") else v for k, v in model.state_dict().items()}
    sd["1.2._extra_state"] = _nan_scale(sd["1.2._extra_state"])
    before = _snapshot_all(model[1])
    with pytest.raises(ValueError, match="finite and positive"):
        model[1].load_state_dict({k.removeprefix("1."): v for k, v in sd.items() if k[:2] == "1."})
    _assert_bytewise_unchanged(model[1], before)
    fc.convert(model)  # converts nothing more; guards the root
    before = _snapshot_all(model)
    with pytest.raises(ValueError, match="finite and positive"):
        model.load_state_dict(sd)
    _assert_bytewise_unchanged(model, before)


@settings(max_examples=25, deadline=None)
@given(
    depth=st.integers(1, 3),
    layers=st.integers(2, 4),
    bad=st.integers(0, 3),
    strict=st.booleans(),
    assign=st.booleans(),
)
def test_property_refused_loads_change_nothing(depth, layers, bad, strict, assign):
    """Models of fc.Linear layers nested ``depth`` containers deep, a bad state in any
    one layer: the load is refused and every parameter and extra state is as before."""

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(*[fc.Linear(16, 16) for _ in range(layers)])
        for _ in range(depth - 1):
            model = nn.Sequential(nn.LayerNorm(16), model)
        return _train(model, steps=1, seed=seed)

    source, target = build(0), build(3)
    sd = source.state_dict()
    key = [k for k in sd if k.endswith("_extra_state")][bad % layers]
    sd[key] = _nan_scale(sd[key])
    before = _snapshot_all(target)
    with pytest.raises(ValueError, match="finite and positive"):
        target.load_state_dict(sd, strict=strict, assign=assign)
    _assert_bytewise_unchanged(target, before)
