"""Plain checkpoints (issue 36): under every stateless recipe, and without any recipe, a
converted model's state dict is the plain model's (keys, shapes, dtypes), so Hugging
Face's ``from_pretrained`` of the plain class, safetensors, ``torch.load(weights_only=
True)`` and DCP see nothing of fastcast; only DelayedScaling saves ``_extra_state``.
Loading a checkpoint of one kind into a model of the other is a documented conversion
or an error, with a warning saying which; checkpoints of earlier versions (a 16-value
header per layer under stateless recipes) still load."""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

import pytest
import torch
from _tiny_models import VOCAB, tiny_gpt2, tiny_llama, tiny_qwen3_moe
from torch import nn

import fastcast as fc
from fastcast.serialization.extra_state import _STATELESS_HEADER

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

pytestmark = pytest.mark.usefixtures("single_thread")

# None: converted, used without any recipe (trained outside fc.autocast).
STATELESS = {
    "none": None,
    "current": fc.Float8CurrentScaling(),
    "rowwise": fc.Float8RowwiseScaling(),
    "block": fc.Float8BlockScaling(),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(),
}
DELAYED = fc.DelayedScaling(amax_history_len=4)
FIXTURES = Path(__file__).parents[1] / "fixtures" / "extra_state"
# DCP warns that it runs in one process when torch.distributed is not initialised.
_DCP_WARNING = "ignore:torch.distributed is disabled:UserWarning"
_AFRESH = "start afresh"


# One block each; ``_build`` seeds the generator.
_llama = functools.partial(tiny_llama, layers=1, seed=None)
_gpt2 = functools.partial(tiny_gpt2, layers=1, seed=None)  # transformers' Conv1D layers
# transformers 5 experts, on fastcast's grouped GEMM once converted
_qwen3_moe = functools.partial(tiny_qwen3_moe, seed=None)
MODELS = {"llama": _llama, "gpt2": _gpt2, "qwen3-moe": _qwen3_moe}


def _build(build, recipe, seed=0, convert=True):
    torch.manual_seed(seed)
    model = build()
    return fc.convert(model, recipe=recipe) if convert else model


def _trained(build, recipe, seed=0):
    """A converted model after one training step under ``recipe`` (outside fc.autocast
    for None)."""
    model = _build(build, recipe, seed)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    with fc.autocast(enabled=recipe is not None, recipe=recipe):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return model


def _layout(sd):
    return [(k, tuple(v.shape), v.dtype) for k, v in sd.items()]


def _assert_equal_state(a, b):
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", list(STATELESS))
@pytest.mark.parametrize("model", list(MODELS))
def test_stateless_state_dict_is_the_plain_models(name, model):
    recipe = STATELESS[name]
    plain = _build(MODELS[model], None, convert=False)
    converted = _trained(MODELS[model], recipe)
    assert any(isinstance(m, fc.Linear) for m in converted.modules())
    assert _layout(converted.state_dict()) == _layout(plain.state_dict())


def test_only_delayed_scaling_adds_extra_state():
    plain_keys = list(_build(_qwen3_moe, None, convert=False).state_dict())
    model = _build(_qwen3_moe, DELAYED)  # the layout up front, before any step
    layers = [n for n, m in model.named_modules() if isinstance(m, fc.Linear)]
    extra = [f"{n}._extra_state" for n in layers]
    assert sorted(model.state_dict()) == sorted(plain_keys + extra)
    assert list(_trained(_qwen3_moe, DELAYED).state_dict()) == list(model.state_dict())


def test_grouped_linear_state_dict_is_plain():
    layer = fc.GroupedLinear(4, 32, 16, bias=True)
    offs = torch.tensor([8, 8, 24, 32], dtype=torch.int32)
    for recipe in (fc.Float8CurrentScaling(), fc.MXFP8BlockScaling(), DELAYED):
        with fc.autocast(recipe=recipe):
            layer(torch.randn(32, 32), offs).sum().backward()
        assert _layout(layer.state_dict()) == [
            ("weight", (4, 16, 32), torch.float32),
            ("bias", (4, 16), torch.float32),
        ]


# -- Hugging Face ------------------------------------------------------------------------------
def _from_pretrained(cls, path, capfd, caplog):
    """``cls.from_pretrained(path)`` with its loading info and what it printed or logged
    (transformers logs its load report as a WARNING)."""
    capfd.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        model, info = cls.from_pretrained(path, output_loading_info=True)
    out, err = capfd.readouterr()
    return model, info, out + err + caplog.text


@pytest.mark.parametrize("name", list(STATELESS))
@pytest.mark.parametrize("model", list(MODELS))
def test_save_pretrained_reloads_into_the_plain_class_without_a_load_report(
    name, model, capfd, caplog, tmp_path
):
    trained = _trained(MODELS[model], STATELESS[name])
    trained.save_pretrained(tmp_path)
    saved = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert not any(k.endswith("_extra_state") for k in saved)
    plain, info, printed = _from_pretrained(type(trained), tmp_path, capfd, caplog)
    assert not any(isinstance(m, fc.Linear) for m in plain.modules())
    assert info["unexpected_keys"] == set() or not info["unexpected_keys"]
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert "LOAD REPORT" not in printed and "UNEXPECTED" not in printed, printed
    _assert_equal_state(plain.state_dict(), trained.state_dict())


def test_the_load_report_is_captured_when_there_is_one(capfd, caplog, tmp_path):
    """The check above can fail: a delayed-scaling checkpoint's extra states are reported
    (expected, and documented: they are the scales)."""
    trained = _trained(_llama, DELAYED)
    trained.save_pretrained(tmp_path)
    _, info, printed = _from_pretrained(transformers.LlamaForCausalLM, tmp_path, capfd, caplog)
    assert info["unexpected_keys"]
    assert "LOAD REPORT" in printed and "_extra_state" in printed


# -- state-dict files and DCP ------------------------------------------------------------------
FILES = {
    "safetensors": (safetensors_torch.save_file, safetensors_torch.load_file),
    "weights_only": (torch.save, lambda path: torch.load(path, weights_only=True, mmap=True)),
}


@pytest.mark.parametrize("name", ["none", "current", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("file", list(FILES))
def test_files_load_strictly_into_plain_and_converted_models(file, name, tmp_path):
    save, load = FILES[file]
    recipe = STATELESS[name]
    trained = _trained(_llama, recipe)
    save(trained.state_dict(), tmp_path / "sd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to convert: no warning
        plain = _build(_llama, None, seed=1, convert=False)
        plain.load_state_dict(load(tmp_path / "sd"))  # strict
        fresh = _build(_llama, recipe, seed=1)
        fresh.load_state_dict(load(tmp_path / "sd"))
    _assert_equal_state(plain.state_dict(), trained.state_dict())
    _assert_equal_state(fresh.state_dict(), trained.state_dict())


@pytest.mark.filterwarnings(_DCP_WARNING)
def test_dcp_checkpoint_of_a_stateless_recipe_is_the_plain_models(tmp_path):
    import fastcast.dcp

    trained = _trained(_qwen3_moe, fc.MXFP8BlockScaling())
    dcp.save({"model": trained.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    saved = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    plain = _build(_qwen3_moe, None, seed=1, convert=False)
    assert set(saved) == {f"model.{k}" for k in plain.state_dict()}
    sd = {"model": plain.state_dict()}
    dcp.load(sd, checkpoint_id=tmp_path, no_dist=True)
    plain.load_state_dict(sd["model"])
    _assert_equal_state(plain.state_dict(), trained.state_dict())
    fresh = _build(_qwen3_moe, fc.MXFP8BlockScaling(), seed=1)
    sd = {"model": fresh.state_dict()}
    fastcast.dcp.load(sd, checkpoint_id=tmp_path, no_dist=True)
    fresh.load_state_dict(sd["model"])
    _assert_equal_state(fresh.state_dict(), trained.state_dict())


# -- one kind into the other -------------------------------------------------------------------
def _extra_keys(sd):
    return [k for k in sd if k.endswith("._extra_state")]


def test_delayed_checkpoint_into_a_stateless_model_is_refused_or_dropped_with_a_warning():
    trained = _trained(_llama, DELAYED)
    sd = trained.state_dict()
    extra = _extra_keys(sd)
    model = _build(_llama, fc.Float8CurrentScaling(), seed=1)
    with pytest.warns(UserWarning, match="converted for Float8CurrentScaling") as caught:
        with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*_extra_state"):
            model.load_state_dict(sd)  # strict: torch's error for unexpected keys
    assert "fc.strip_extra_state" in str(caught[0].message)
    with pytest.warns(UserWarning, match="strict=False drops the state"):
        result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == [] and sorted(result.unexpected_keys) == sorted(extra)
    assert _extra_keys(model.state_dict()) == []  # still plain: the scales were dropped
    _assert_equal_state(model.state_dict(), fc.strip_extra_state(sd))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict(fc.strip_extra_state(sd))  # the quiet way to drop them


def test_delayed_checkpoint_into_a_model_converted_without_recipe_takes_the_scales():
    trained = _trained(_llama, DELAYED)
    model = _build(_llama, None, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = model.load_state_dict(trained.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_equal_state(model.state_dict(), trained.state_dict())


def test_a_later_delayed_recipe_makes_a_stateless_layer_take_the_scales():
    trained = _trained(_llama, DELAYED)
    model = _build(_llama, fc.Float8CurrentScaling(), seed=1)
    fc.convert(model, recipe=DELAYED)  # now prepared for DelayedScaling
    model.load_state_dict(trained.state_dict())
    _assert_equal_state(model.state_dict(), trained.state_dict())


@pytest.mark.parametrize("name", ["none", "current", "nvfp4"])
def test_stateless_checkpoint_into_a_delayed_model_starts_the_scales_afresh(name):
    trained = _trained(_llama, STATELESS[name])
    model = _build(_llama, DELAYED, seed=1)
    with pytest.warns(UserWarning, match=_AFRESH):
        result = model.load_state_dict(trained.state_dict())  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_equal_state(fc.strip_extra_state(model.state_dict()), trained.state_dict())
    for key in _extra_keys(model.state_dict()):
        view = fc.read_extra_state(model.state_dict()[key])
        assert torch.equal(view["forward"]["scale"], torch.ones(2))


# -- checkpoints of earlier versions: a 16-value header per stateless layer ------------------------
def _fixture_model(seed=1):
    """The model the fixtures were saved from (tests/fixtures/extra_state/make_v*.py)."""
    torch.manual_seed(seed)
    return nn.Sequential(fc.Linear(16, 24), nn.ReLU(), fc.Linear(24, 8))


@pytest.mark.parametrize(
    "load",
    [
        lambda: safetensors_torch.load_file(FIXTURES / "v2_stateless.safetensors"),
        lambda: torch.load(FIXTURES / "v1_stateless.pt", weights_only=True),
    ],
    ids=["v2-safetensors", "v1-torch"],
)
def test_earlier_stateless_checkpoints_load_and_their_headers_are_dropped(load):
    old = load()
    assert _extra_keys(old) or "0._extra_state" in old  # the headers are there
    for recipe in (None, fc.Float8CurrentScaling()):
        model = _fixture_model(seed=5)
        if recipe is not None:
            fc.convert(model, recipe=recipe)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = model.load_state_dict(old)  # strict
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert torch.equal(model[0].weight, old["0.weight"])
    delayed = fc.convert(_fixture_model(seed=5), recipe=DELAYED)
    with pytest.warns(UserWarning, match=_AFRESH):
        delayed.load_state_dict(old)
    assert len(_extra_keys(delayed.state_dict())) == 2  # the prepared layout stays
    # ... and into a plain model, once the headers are stripped.
    torch.manual_seed(5)
    plain = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    plain.load_state_dict(fc.strip_extra_state(old))


@pytest.mark.filterwarnings(_DCP_WARNING)
def test_earlier_stateless_dcp_checkpoints_load(tmp_path):
    """An earlier version's DCP checkpoint of a stateless recipe (a header per layer):
    DCP's planner and fastcast's read the weights and leave the headers; into a model
    prepared for DelayedScaling, fastcast's planner starts the scales afresh."""
    import fastcast.dcp

    trained = _trained(_llama, fc.Float8CurrentScaling())
    old = dict(trained.state_dict())
    layers = [n for n, m in trained.named_modules() if isinstance(m, fc.Linear)]
    for name in layers:
        old[f"{name}._extra_state"] = torch.tensor(_STATELESS_HEADER)
    dcp.save({"model": old}, checkpoint_id=tmp_path, no_dist=True)

    for load in (dcp.load, fastcast.dcp.load):
        model = _build(_llama, fc.Float8CurrentScaling(), seed=1)
        sd = {"model": model.state_dict()}
        load(sd, checkpoint_id=tmp_path, no_dist=True)
        model.load_state_dict(sd["model"])
        _assert_equal_state(model.state_dict(), trained.state_dict())

    model = _build(_llama, DELAYED, seed=1)
    sd = {"model": model.state_dict()}
    fastcast.dcp.load(sd, checkpoint_id=tmp_path, no_dist=True)  # sizes them as saved
    with pytest.warns(UserWarning, match=_AFRESH):
        model.load_state_dict(sd["model"])
    _assert_equal_state(fc.strip_extra_state(model.state_dict()), trained.state_dict())
    assert len(_extra_keys(model.state_dict())) == len(layers)
