"""Checkpoint flows users run, for every recipe, on a tiny Hugging Face Llama: save after
two training steps, load into a freshly built model, and the next training step (loss,
logits, every gradient, and the state it leaves) is bit-for-bit the original's.

Flows: ``save_pretrained`` (loaded back into a converted model with ``load_state_dict``,
and into a plain one with ``from_pretrained``), safetensors ``save_file``/``load_file``,
``torch.save`` of the state dict with ``torch.load(weights_only=True, mmap=True)``, DCP
into a model that has never run, ``torch.save`` of the whole model, and ``deepcopy``.

Delayed-scaling state lives in per-thread slabs (``fastcast.runtime.state.thread_state`` is a
``threading.local``; a fresh ``contextvars.Context`` shares its thread's). A slab update
moves only the columns of modules that ran, so models sharing a thread stay apart (the
copy tests check exactly that); still, each model runs in a worker thread of its own,
standing for a process: the original trains and takes its next step in one (the same
process carrying on), every reloaded model or copy in another (a new process). The
loaded model is always built with another seed, so a flow that lost the weights or the
delayed-scaling state would show.
"""

from __future__ import annotations

import copy
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest
import torch

import fastcast as fc

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

pytestmark = pytest.mark.usefixtures("single_thread")

RECIPES = {
    "delayed": lambda: fc.DelayedScaling(amax_history_len=8),
    "current": fc.Float8CurrentScaling,
    "block": fc.Float8BlockScaling,
    "mxfp8": fc.MXFP8BlockScaling,
    "nvfp4": fc.NVFP4BlockScaling,
    "rowwise": fc.Float8RowwiseScaling,
    "rowwise-gw-hp": lambda: fc.Float8RowwiseScaling(wgrad_high_precision=True),
}
VOCAB = 128
LR = 0.1
EXTRA = "._extra_state"


@pytest.fixture(params=list(RECIPES))
def recipe(request):
    return RECIPES[request.param]()


def _config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )


def _build(recipe, seed):
    """A freshly built Llama (float32, CPU), converted with ``recipe``."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_config())
    model.train()
    return fc.convert(model, recipe=recipe)


def _batch(seed):
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


class Step(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


def _step(model, recipe, seed):
    """One training step: forward and backward under fc.autocast, then plain SGD (no
    GradScaler, no optimizer state). What it computed, before the update."""
    model.zero_grad(set_to_none=True)
    ids = _batch(seed)
    # Stochastic rounding (NVFP4's default, for gradients) draws from the global
    # generator, whose state is the user's to save: the same per step in every run.
    torch.manual_seed(seed)
    with fc.autocast(recipe=recipe):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    step = Step(
        out.loss.detach(),
        out.logits.detach(),
        {n: p.grad.clone() for n, p in model.named_parameters()},
    )
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.zero_grad(set_to_none=True)
    return step


class Worker:
    """A thread of its own for one model: its delayed-scaling slabs are nobody else's."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1)

    def run(self, fn, *args):
        return self._pool.submit(fn, *args).result(timeout=120)

    def close(self):
        self._pool.shutdown(wait=True)


@pytest.fixture
def worker():
    """``worker()``: a new Worker, shut down after the test."""
    made = []

    def make():
        made.append(Worker())
        return made[-1]

    yield make
    for w in made:
        w.close()


def _trained(recipe, worker, seed=0, steps=2):
    """A converted Llama after ``steps`` training steps run on ``worker``."""
    model = _build(recipe, seed)
    for i in range(steps):
        worker.run(_step, model, recipe, 100 + i)
    return model


NEXT = 1000  # the batch of the step after the checkpoint


def _next_step(model, recipe, worker):
    """The step after the checkpoint, on ``worker``."""
    return worker.run(_step, model, recipe, NEXT)


def _assert_same_step(a, b):
    assert torch.equal(a.loss, b.loss), (a.loss, b.loss)
    assert torch.equal(a.logits, b.logits)
    assert a.grads.keys() == b.grads.keys()
    unequal = [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])]
    assert unequal == []


def _snapshot(model):
    """The model's state dict, cloned (parameters and fastcast extra states)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _differing(a, b):
    """Keys whose values are not bit-for-bit equal; AssertionError if the keys differ.
    ``a``/``b``: models or state dicts."""
    a = a.state_dict() if isinstance(a, torch.nn.Module) else a
    b = b.state_dict() if isinstance(b, torch.nn.Module) else b
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return [
        k
        for k in a
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])
    ]


def _extra_keys(sd):
    return [k for k in sd if k.endswith(EXTRA)]


def _fresh_differs(fresh, original, recipe):
    """The model about to load differs from the original: in its weights, and, under
    delayed scaling, in every layer's scales (so a flow that lost them would show)."""
    diff = _differing(fresh, original)
    assert any(not k.endswith(EXTRA) for k in diff)
    if isinstance(recipe, fc.DelayedScaling):
        assert set(_extra_keys(diff)) == set(_extra_keys(original.state_dict()))
        for key in _extra_keys(original.state_dict()):
            state = fc.read_extra_state(original.state_dict()[key])
            assert state["kind"] == "delayed_scaling"
            assert not torch.equal(state["forward"]["scale"], torch.ones(2))


def _assert_resumes_like(loaded, original, trainer, recipe, worker):
    """``loaded`` holds exactly ``original``'s state, and the next step of each (the
    original on ``trainer``, the thread it trained on; ``loaded`` on a new one) is the
    same, as is the state it leaves."""
    assert _differing(loaded, original) == []
    _assert_same_step(_next_step(loaded, recipe, worker()), _next_step(original, recipe, trainer))
    assert _differing(loaded, original) == []


def _load_strict(model, sd):
    result = model.load_state_dict(sd, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []


# -- Hugging Face ------------------------------------------------------------------------------
def _read_safetensors_dir(path):
    """All tensors of a save_pretrained directory (shards merged)."""
    files = sorted(path.glob("*.safetensors"))
    assert files, sorted(p.name for p in path.iterdir())
    index = path / "model.safetensors.index.json"
    if index.exists():
        listed = set(json.loads(index.read_text())["weight_map"].values())
        assert listed == {f.name for f in files}
    merged = {}
    for f in files:
        shard = safetensors_torch.load_file(f)
        assert merged.keys().isdisjoint(shard)
        merged.update(shard)
    return merged


@pytest.mark.parametrize("shard", [None, "200KB"], ids=["one-file", "sharded"])
def test_save_pretrained_loads_into_a_converted_model(recipe, shard, worker, tmp_path):
    trainer = worker()
    original = _trained(recipe, trainer)
    kwargs = {} if shard is None else {"max_shard_size": shard}
    original.save_pretrained(tmp_path, **kwargs)
    assert not list(tmp_path.glob("*.bin"))
    assert (shard is not None) == (len(list(tmp_path.glob("*.safetensors"))) > 1)
    loaded = _read_safetensors_dir(tmp_path)
    assert loaded.keys() == original.state_dict().keys()  # no extra state left behind
    for key in _extra_keys(loaded):
        assert loaded[key].dtype == torch.float32 and loaded[key].dim() == 1

    fresh = _build(recipe, seed=1)
    _fresh_differs(fresh, original, recipe)
    _load_strict(fresh, loaded)
    _assert_resumes_like(fresh, original, trainer, recipe, worker)


def test_save_pretrained_loads_into_a_plain_model(recipe, worker, tmp_path):
    """``from_pretrained`` into an unconverted model: the weights load; the extra states
    are reported as unexpected keys (transformers' load report), not an error."""
    original = _trained(recipe, worker())
    original.save_pretrained(tmp_path)
    plain, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert not any(isinstance(m, fc.Linear) for m in plain.modules())
    assert not info["missing_keys"]
    assert sorted(info["unexpected_keys"]) == sorted(_extra_keys(original.state_dict()))
    assert not info["mismatched_keys"] and not info["error_msgs"]
    expected = fc.strip_extra_state(original.state_dict())
    assert _differing(plain.state_dict(), expected) == []
    # The plain model computes what the converted one does outside fc.autocast.
    ids = _batch(NEXT)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, original(input_ids=ids).logits)


# -- state-dict files ----------------------------------------------------------------------
FILE_FORMATS = {
    "safetensors": (safetensors_torch.save_file, safetensors_torch.load_file),
    "torch-weights_only-mmap": (
        torch.save,
        lambda path: torch.load(path, weights_only=True, mmap=True),
    ),
}


@pytest.mark.parametrize("file_format", list(FILE_FORMATS))
def test_state_dict_file_round_trip(file_format, recipe, worker, tmp_path):
    save, load = FILE_FORMATS[file_format]
    trainer = worker()
    original = _trained(recipe, trainer)
    path = tmp_path / "model"
    save(original.state_dict(), path)
    fresh = _build(recipe, seed=1)
    _fresh_differs(fresh, original, recipe)
    _load_strict(fresh, load(path))
    _assert_resumes_like(fresh, original, trainer, recipe, worker)


def test_the_next_step_sees_a_lost_delayed_scaling_state(worker):
    """The comparisons above can fail: the weights alone (scales started afresh) give
    another next step under delayed scaling."""
    recipe = RECIPES["delayed"]()
    trainer = worker()
    original = _trained(recipe, trainer)
    fresh = _build(recipe, seed=1)
    _load_strict(fresh, fc.strip_extra_state(original.state_dict()))
    assert _differing(fresh, original) == _extra_keys(original.state_dict())
    lost = _next_step(fresh, recipe, worker())
    assert not torch.equal(lost.logits, _next_step(original, recipe, trainer).logits)


# -- torch.distributed.checkpoint ------------------------------------------------------------------
# Single process, no process group. torch 2.13's DCP falls back to one process by itself
# when torch.distributed is not initialised; no_dist=True asks for that explicitly. It
# still warns "torch.distributed is disabled, unavailable or uninitialized, assuming the
# intent is to save/load in a single process" (filtered below).
_DCP_WARNING = "ignore:torch.distributed is disabled:UserWarning"


@pytest.mark.filterwarnings(_DCP_WARNING)
def test_dcp_round_trip_into_a_model_that_never_ran(recipe, worker, tmp_path):
    trainer = worker()
    original = _trained(recipe, trainer)
    dcp.save({"model": original.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    fresh = _build(recipe, seed=1)  # converted with the recipe: the trained layout
    _fresh_differs(fresh, original, recipe)
    sd = fresh.state_dict()
    dcp.load({"model": sd}, checkpoint_id=tmp_path, no_dist=True)
    _load_strict(fresh, sd)
    _assert_resumes_like(fresh, original, trainer, recipe, worker)


@pytest.mark.filterwarnings(_DCP_WARNING)
def test_dcp_of_a_plain_checkpoint_into_a_delayed_model_is_an_error(worker, tmp_path):
    """DCP loads in place, so the target's entries must be in the checkpoint. A stateless
    checkpoint (plain keys) into a model converted for DelayedScaling (its extra-state
    entries prepared) fails in DCP's load planner, naming an extra-state key, before
    anything is written. (DCP raises a CheckpointException, which derives from
    BaseException: ``except Exception`` misses it.)"""
    original = _trained(RECIPES["current"](), worker())
    assert _extra_keys(original.state_dict()) == []
    dcp.save({"model": original.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    fresh = _build(RECIPES["delayed"](), seed=1)
    sd = fresh.state_dict()
    before = _snapshot(fresh)
    with pytest.raises(dcp.api.CheckpointException, match=r"Missing key .*\._extra_state"):
        dcp.load({"model": sd}, checkpoint_id=tmp_path, no_dist=True)
    assert _differing(sd, before) == []  # nothing half-loaded
    assert _differing(fresh, before) == []


@pytest.mark.filterwarnings(_DCP_WARNING)
def test_dcp_default_planner_reads_only_the_targets_entries(worker, tmp_path):
    """The caveat docs/checkpoints.md states: DCP's own planner reads the entries the
    target state dict has, nothing else. A delayed-scaling checkpoint into a model
    converted without ``recipe=`` (plain keys) loads the weights and no scales;
    ``fastcast.dcp`` (next tests) reads them."""
    original = _trained(RECIPES["delayed"](), worker())
    dcp.save({"model": original.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    fresh = _build(None, seed=1)
    sd = fresh.state_dict()
    assert _extra_keys(sd) == []
    dcp.load({"model": sd}, checkpoint_id=tmp_path, no_dist=True)
    _load_strict(fresh, sd)
    assert _differing(fresh, fc.strip_extra_state(original.state_dict())) == []
    assert all(m._scheme_state == {} for m in fresh.modules() if isinstance(m, fc.Linear))


def _fastcast_dcp_load(sd, path):
    import fastcast.dcp

    fastcast.dcp.load(sd, checkpoint_id=path, no_dist=True)


def _dcp_load_with_planner(sd, path):
    """``dcp.load`` as docs/checkpoints.md gives it: the planner, and the reader that
    reads the metadata without running it (with ``checkpoint_id`` alone DCP unpickles it
    before the planner is called)."""
    import fastcast.dcp

    reader = fastcast.dcp.SafeFileSystemReader(path)
    dcp.load(sd, storage_reader=reader, planner=fastcast.dcp.LoadPlanner(), no_dist=True)


DCP_LOADS = {"fastcast.dcp.load": _fastcast_dcp_load, "LoadPlanner": _dcp_load_with_planner}


@pytest.mark.filterwarnings(_DCP_WARNING)
@pytest.mark.parametrize("how", list(DCP_LOADS))
@pytest.mark.parametrize(
    ("saved", "loading"),
    [("delayed", None), ("current", "delayed"), ("delayed", "delayed-16")],
    ids=["delayed-into-unprepared", "stateless-into-delayed", "another-history-length"],
)
def test_dcp_with_fastcasts_planner_loads_any_state_layout(saved, loading, how, worker, tmp_path):
    """``fastcast.dcp.LoadPlanner`` (and ``fastcast.dcp.load``, which uses it) fits the
    extra-state entries to the checkpoint: the model then holds exactly the saved state,
    whatever layout it was built with (or, from a stateless checkpoint, fresh scales)."""

    trainer = worker()
    original = _trained(RECIPES[saved](), trainer)
    dcp.save({"model": original.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    target = {
        None: None,
        "delayed": RECIPES["delayed"](),
        "delayed-16": fc.DelayedScaling(amax_history_len=16),
    }[loading]
    fresh = _build(target, seed=1)
    sd = {"model": fresh.state_dict()}
    DCP_LOADS[how](sd, tmp_path)
    if saved == "delayed":
        _load_strict(fresh, sd["model"])
        assert _differing(fresh, original) == []
        _assert_resumes_like(fresh, original, trainer, RECIPES[saved](), worker)
        return
    # A stateless checkpoint has no scales: the planner leaves the target's extra-state
    # entries out, and load_state_dict starts them afresh, saying so.
    assert _extra_keys(sd["model"]) == []
    with pytest.warns(UserWarning, match="start afresh"):
        _load_strict(fresh, sd["model"])
    assert _differing(fc.strip_extra_state(fresh.state_dict()), original) == []
    for key in _extra_keys(fresh.state_dict()):
        state = fc.read_extra_state(fresh.state_dict()[key])
        assert torch.equal(state["forward"]["scale"], torch.ones(2))
        assert not state["forward"]["amax_history"].any()
    step = _next_step(fresh, RECIPES[saved](), worker())
    _assert_same_step(step, _next_step(original, RECIPES[saved](), trainer))


@pytest.mark.filterwarnings(_DCP_WARNING)
@pytest.mark.parametrize("how", list(DCP_LOADS))
def test_dcp_refuses_a_bad_scale_before_writing_anything(how, worker, tmp_path):
    """A NaN scale in the third layer's extra state: DCP writes the parameters of
    ``model.state_dict()`` in place, so the refusal must come before any read lands in
    the model (not in ``load_state_dict`` afterwards, with new weights and old scales).
    ``fastcast.dcp.load`` raises the ValueError itself; with the planner it is inside
    DCP's CheckpointException. Either way every parameter and extra state is as before,
    and the model still loads the good checkpoint afterwards."""
    original = _trained(RECIPES["delayed"](), worker())
    sd = original.state_dict()
    key = _extra_keys(sd)[2]
    bad = dict(sd)
    bad[key] = sd[key].clone()
    bad[key][16] = float("nan")  # the first forward scale
    dcp.save({"model": bad}, checkpoint_id=tmp_path / "bad", no_dist=True)
    dcp.save({"model": sd}, checkpoint_id=tmp_path / "good", no_dist=True)
    fresh = _build(RECIPES["delayed"](), seed=1)
    before = _snapshot(fresh)
    target = {"model": fresh.state_dict()}
    if how == "fastcast.dcp.load":
        with pytest.raises(ValueError, match=rf"'model\.{re.escape(key)}'.*finite and positive"):
            DCP_LOADS[how](target, tmp_path / "bad")
    else:
        with pytest.raises(dcp.api.CheckpointException) as refused:
            DCP_LOADS[how](target, tmp_path / "bad")
        ((cause, _),) = refused.value.failures.values()
        assert isinstance(cause, ValueError) and "finite and positive" in str(cause)
    assert _differing(fresh, before) == []
    DCP_LOADS[how](target, tmp_path / "good")
    _load_strict(fresh, target["model"])
    assert _differing(fresh, original) == []


@pytest.mark.filterwarnings(_DCP_WARNING)
def test_dcp_size_mismatch_is_a_clear_value_error(worker, tmp_path):
    """A checkpoint of another model size: ``fastcast.dcp.load`` refuses before reading
    anything, with a ValueError (``except Exception`` catches it, unlike DCP's
    CheckpointException) that names each entry, both sizes and the way to load."""
    import fastcast.dcp

    torch.manual_seed(0)
    config = _config()
    config.intermediate_size = 192
    other = fc.convert(transformers.LlamaForCausalLM(config))
    dcp.save({"model": other.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    fresh = _build(RECIPES["current"](), seed=1)
    before = _snapshot(fresh)
    try:
        fastcast.dcp.load({"model": fresh.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    except Exception as exc:  # noqa: BLE001 - the point: an ordinary exception
        refused = exc
    else:
        pytest.fail("the mismatched checkpoint loaded")
    assert isinstance(refused, fastcast.dcp.CheckpointMismatchError)
    assert isinstance(refused, ValueError)
    message = str(refused)
    assert (
        "'model.model.layers.0.mlp.gate_proj.weight': saved (192, 64), target (128, 64)" in message
    )
    assert "LoadPlanner" in message
    assert _differing(fresh, before) == []


# -- whole-model pickles and copies --------------------------------------------------------------
def _copy(model, how, tmp_path):
    if how == "deepcopy":
        return copy.deepcopy(model)
    path = tmp_path / "whole.pt"
    torch.save(model, path)
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_resume_alike_and_train_independently(recipe, how, worker, tmp_path):
    trainer = worker()
    original = _trained(recipe, trainer)
    before = _snapshot(original)
    twin = _copy(original, how, tmp_path)
    assert twin is not original and _differing(twin, original) == []

    # Training the copy moves its weights (and delayed scales), not the original's.
    twin_step = _next_step(twin, recipe, worker())
    moved = _differing(twin, before)
    assert any(not k.endswith(EXTRA) for k in moved)
    if isinstance(recipe, fc.DelayedScaling):
        assert set(_extra_keys(moved)) == set(_extra_keys(before))
    assert _differing(original, before) == []

    # Training the original moves it exactly as the copy moved, and leaves the copy alone.
    twin_after = _snapshot(twin)
    _assert_same_step(_next_step(original, recipe, trainer), twin_step)
    assert _differing(twin, twin_after) == []
    assert _differing(original, twin) == []


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_training_a_copy_on_the_same_thread_leaves_the_original_alone(name, how, worker, tmp_path):
    """One process, one thread: the user trains a copy (an EMA/eval twin, or a model
    reloaded from ``torch.save(model)``) next to the original."""
    recipe = RECIPES[name]()
    trainer = worker()
    original = _trained(recipe, trainer)
    before = _snapshot(original)
    twin = _copy(original, how, tmp_path)
    reference = copy.deepcopy(original)
    trainer.run(_step, twin, recipe, NEXT)  # the copy trains where the original did
    assert _differing(twin, before)
    assert _differing(original, before) == []
    # Nor does the original's next step change: it is what an untouched copy computes.
    _assert_same_step(
        _next_step(original, recipe, trainer), _next_step(reference, recipe, worker())
    )
