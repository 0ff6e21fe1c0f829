"""DCP checkpoints that fastcast must refuse without running or writing anything.

- A ``.metadata`` that is not what DCP's writer pickles (a payload calling ``os.system``
  or ``builtins.open``, alone or inside a real metadata) is refused, described, by every
  loader fastcast documents: ``fastcast.dcp.load`` (given a path, a ``FileSystemReader``
  or a ``SafeFileSystemReader``) and ``dcp.load`` with ``SafeFileSystemReader`` and
  ``LoadPlanner``. The payloads would create a marker file: it never appears, and the
  model is unchanged. Real metadata (one process; FSDP2 and tensor-parallel fixtures,
  ``tests/fixtures/dcp_metadata``) reads as ``pickle`` reads it.
- An entry saved as bytes is read with the restricted unpickler (DCP's planner gives it
  to ``torch.load(weights_only=False)``).
- ``fastcast.dcp.load`` is all or nothing: extra states saved as TransformerEngine saves
  them (bytes, ``bytearray``, ``io.BytesIO``, uint8 tensors) and a header field out of
  range are refused before any weight is written, naming the entry; inside
  ``fc.allow_unsafe_extra_state()`` TransformerEngine's state loads.

Small models in one process (``no_dist=True``); ``tests/flows/test_checkpoint_flows.py``
has the full flows on a Llama.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from test_checkpoint import _te_pickle, _te_state
from test_extra_state import _assert_unchanged, _snapshot, _steps
from torch import nn

import fastcast as fc

dcp = pytest.importorskip("torch.distributed.checkpoint")
import fastcast.dcp  # noqa: E402 - after the skip: it imports torch.distributed.checkpoint
from fastcast.serialization.dcp_metadata import read_metadata  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    # One process without a process group: DCP says so, each time.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

RECIPE = fc.DelayedScaling(amax_history_len=4)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcp_metadata"


def _model(seed=0, trained=True):
    torch.manual_seed(seed)
    model = fc.convert(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), recipe=RECIPE
    )
    return _steps(model, RECIPE, seed=seed) if trained else model


def _save(path, state):
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


# -- hostile .metadata ----------------------------------------------------------------------------
class _Run:
    """Pickles as a call of ``func(*args)``: what a crafted file runs on ``pickle.load``."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _system(marker):
    return _Run(os.system, f"touch {marker}")


def _open(marker):
    return _Run(builtins.open, str(marker), "w")


def _inside_real(marker, good):
    """The checkpoint's real metadata with a payload among its planner data."""
    metadata = read_metadata(good, "good")
    metadata.planner_data = {"model.0.weight": _system(marker)}
    return pickle.dumps(metadata)


PAYLOADS = {
    "os.system": lambda marker, good: pickle.dumps(_system(marker)),
    "builtins.open": lambda marker, good: pickle.dumps(_open(marker)),
    "os.system, protocol 0": lambda marker, good: pickle.dumps(_system(marker), protocol=0),
    "inside a real metadata": _inside_real,
}
NAMES = {
    "os.system": "posix.system",
    "builtins.open": "io.open",
    "os.system, protocol 0": "posix.system",
    "inside a real metadata": "posix.system",
}


def _fastcast_load(sd, path):
    fastcast.dcp.load(sd, checkpoint_id=path, no_dist=True)


def _fastcast_load_reader(sd, path):
    fastcast.dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)


def _fastcast_load_safe_reader(sd, path):
    fastcast.dcp.load(sd, storage_reader=fastcast.dcp.SafeFileSystemReader(path), no_dist=True)


def _dcp_load_safe(sd, path):
    reader = fastcast.dcp.SafeFileSystemReader(path)
    dcp.load(sd, storage_reader=reader, planner=fastcast.dcp.LoadPlanner(), no_dist=True)


# Every loader fastcast documents.
LOADERS = {
    "fastcast.dcp.load(checkpoint_id)": _fastcast_load,
    "fastcast.dcp.load(FileSystemReader)": _fastcast_load_reader,
    "fastcast.dcp.load(SafeFileSystemReader)": _fastcast_load_safe_reader,
    "dcp.load(SafeFileSystemReader, LoadPlanner)": _dcp_load_safe,
}


def _refused(load, sd, path):
    """The error ``load`` refused with: fastcast's own, or DCP's around it."""
    with pytest.raises(BaseException) as refused:  # noqa: PT011 - DCP's is a BaseException
        load(sd, path)
    error = refused.value
    if isinstance(error, dcp.api.CheckpointException):
        (cause, _), *_ = error.failures.values()
        return cause
    assert isinstance(error, ValueError), repr(error)
    return error


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_a_hostile_metadata_runs_nothing_and_changes_nothing(payload, loader, tmp_path):
    path = _save(tmp_path / "ckpt", {"model": _model().state_dict()})
    marker = tmp_path / "MARKER"
    metadata = path / ".metadata"
    metadata.write_bytes(PAYLOADS[payload](marker, metadata.read_bytes()))
    target = _model(seed=1)
    before = _snapshot(target)
    error = _refused(LOADERS[loader], {"model": target.state_dict()}, path)
    assert not marker.exists()
    _assert_unchanged(target, before)
    message = str(error)
    assert "refusing the checkpoint's metadata" in message
    assert NAMES[payload] in message  # described: what it would have imported
    if loader.startswith("fastcast.dcp.load"):
        assert isinstance(error, fastcast.dcp.CheckpointMetadataError)


def test_a_refused_metadata_is_not_replaced_by_a_ranks_own(tmp_path):
    """DCP reads ``__<rank>.metadata`` when reading ``.metadata`` fails; a refused one is
    refused again, rather than loading whatever the rank's own file says."""
    path = _save(tmp_path / "ckpt", {"model": _model().state_dict()})
    shutil.copy(path / ".metadata", path / "__0.metadata")
    (path / ".metadata").write_bytes(pickle.dumps(_system(tmp_path / "MARKER")))
    target = _model(seed=1)
    before = _snapshot(target)
    error = _refused(_dcp_load_safe, {"model": target.state_dict()}, path)
    assert "posix.system" in str(error)
    assert not (tmp_path / "MARKER").exists()
    _assert_unchanged(target, before)


def _files_moved_to(relative_path):
    def change(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = relative_path

    return change


def _entry_replaced(metadata):
    metadata.state_dict_metadata["model.0.weight"] = "a string"


def _tensor_added(metadata):
    metadata.planner_data = torch.zeros(2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_files_moved_to("../elsewhere.distcp"), "not a file of the checkpoint's folder"),
        (_files_moved_to("/etc/passwd"), "not a file of the checkpoint's folder"),
        (_entry_replaced, "not DCP's TensorStorageMetadata"),
        (_tensor_added, "torch._utils._rebuild_tensor_v2"),
    ],
    ids=["parent folder", "absolute path", "not a storage entry", "a tensor"],
)
def test_metadata_that_dcp_would_not_write_is_refused(change, message, tmp_path):
    path = _save(tmp_path / "ckpt", {"model": _model().state_dict()})
    metadata = read_metadata((path / ".metadata").read_bytes(), "good")
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    target = _model(seed=1)
    before = _snapshot(target)
    with pytest.raises(fastcast.dcp.CheckpointMetadataError, match=message):
        _fastcast_load({"model": target.state_dict()}, path)
    _assert_unchanged(target, before)


@pytest.mark.parametrize("name", ["fsdp2", "tp"])
def test_sharded_checkpoints_metadata_reads_as_pickle_reads_it(name):
    """FSDP2 and tensor-parallel (DTensor) checkpoints of a DelayedScaling model with
    AdamW state and entries saved as bytes (``tests/fixtures/dcp_metadata/make.py``)."""
    data = (FIXTURES / f"{name}.metadata").read_bytes()
    ours, reference = read_metadata(data, name), pickle.loads(data)  # noqa: S301 - our fixture
    assert ours.state_dict_metadata == reference.state_dict_metadata
    assert ours.storage_data == reference.storage_data
    assert ours.planner_data == reference.planner_data
    assert ours.version == reference.version
    assert ours.storage_meta.save_id == reference.storage_meta.save_id
    sizes = {
        k: tuple(v.size) for k, v in ours.state_dict_metadata.items() if k.endswith("_extra_state")
    }
    assert sizes == {"model.0._extra_state": (43,), "model.2._extra_state": (43,)}
    chunks = ours.state_dict_metadata["model.0.weight"].chunks
    assert len(chunks) == 2  # one per rank


def test_a_checkpoint_with_every_kind_of_entry_loads(tmp_path):
    """The metadata of a model, its optimizer and plain entries (saved as bytes) reads as
    ``pickle`` reads it, and ``fastcast.dcp.load`` loads all of it."""
    source = _model()
    opt = torch.optim.AdamW(source.parameters())
    _steps(source, RECIPE)  # gradients for the optimizer's step
    opt.step()
    extra = {"name": "run", "betas": (0.9, 0.99), "flags": [True, None, 2.5]}
    state = {"model": source.state_dict(), "optim": opt.state_dict(), "step": 3, "extra": extra}
    path = _save(tmp_path / "ckpt", state)
    data = (path / ".metadata").read_bytes()
    ours, reference = read_metadata(data, "ckpt"), pickle.loads(data)  # noqa: S301 - ours
    assert ours.state_dict_metadata == reference.state_dict_metadata
    assert ours.storage_data == reference.storage_data
    assert ours.planner_data == reference.planner_data

    target = _model(seed=1)
    target_opt = torch.optim.AdamW(target.parameters())
    _steps(target, RECIPE, seed=1)
    target_opt.step()
    sd = {
        "model": target.state_dict(),
        "optim": target_opt.state_dict(),
        "step": 0,
        "extra": {"name": "", "betas": (0.0, 0.0), "flags": []},
    }
    fastcast.dcp.load(sd, checkpoint_id=path, no_dist=True)
    target.load_state_dict(sd["model"])
    _assert_unchanged(target, source.state_dict())
    assert sd["step"] == 3
    assert sd["extra"] == extra


# -- entries saved as bytes ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "loader", ["fastcast.dcp.load(checkpoint_id)", "dcp.load(SafeFileSystemReader, LoadPlanner)"]
)
def test_a_hostile_bytes_entry_runs_nothing(loader, tmp_path):
    marker = tmp_path / "MARKER"
    state = {"model": _model().state_dict(), "step": _system(marker)}
    path = _save(tmp_path / "ckpt", state)
    target = _model(seed=1)
    before = _snapshot(target)
    error = _refused(LOADERS[loader], {"model": target.state_dict(), "step": 0}, path)
    assert not marker.exists()
    assert "checkpoint entry 'step': refusing to unpickle the entry" in str(error)
    assert "posix.system" in str(error)
    if loader.startswith("fastcast"):  # read before anything else
        _assert_unchanged(target, before)


def test_a_tensor_saved_as_bytes_is_a_mismatch(tmp_path):
    source = _model().state_dict()
    source["0.weight"] = [1, 2]  # a list: DCP saves it as bytes
    path = _save(tmp_path / "ckpt", {"model": source})
    target = _model(seed=1)
    before = _snapshot(target)
    with pytest.raises(
        fastcast.dcp.CheckpointMismatchError, match="'model.0.weight': saved as bytes"
    ):
        _fastcast_load({"model": target.state_dict()}, path)
    _assert_unchanged(target, before)


# -- all or nothing ------------------------------------------------------------------------------
def _te_forms():
    te = _te_pickle(_te_state(), "pickle-bytes")
    return {
        "bytes": lambda: te,
        "bytearray": lambda: bytearray(te),
        "io.BytesIO": lambda: io.BytesIO(te),
        "uint8 tensor": lambda: torch.frombuffer(bytearray(te), dtype=torch.uint8),
        "torch.save in io.BytesIO": lambda: _te_pickle(_te_state(), "torch.save-bytesio"),
    }


TE_FORMS = _te_forms()


@pytest.mark.parametrize("form", list(TE_FORMS))
def test_a_foreign_extra_state_is_refused_before_any_weight_is_written(form, tmp_path):
    """TransformerEngine's extra state (a benign one) in every form it is saved in: outside
    ``fc.allow_unsafe_extra_state()`` refused before layer 0's weight is written; inside
    it, loaded and converted (the same state as ``load_state_dict`` of it gives)."""
    source = _model().state_dict()
    for key in ("0._extra_state", "2._extra_state"):
        source[key] = TE_FORMS[form]()
    path = _save(tmp_path / "ckpt", {"model": source})
    target = _model(seed=1)
    before = _snapshot(target)
    sd = {"model": target.state_dict()}
    with pytest.raises(ValueError, match=r"'model\.0\._extra_state': refusing a pickled extra"):
        _fastcast_load(sd, path)
    _assert_unchanged(target, before)

    with fc.allow_unsafe_extra_state():
        _fastcast_load(sd, path)
        target.load_state_dict(sd["model"])
    state = fc.read_extra_state(target[0].get_extra_state())
    assert torch.equal(state["forward"]["scale"], torch.tensor([3.0, 5.0]))
    assert torch.equal(target[0].weight, source["0.weight"])


@pytest.mark.parametrize(
    ("slot", "value", "message"),
    [
        (9, 1e9, r"invalid margin 1000000000 \(header slot 9"),
        (13, 1.0, "reserved header slot 13"),
    ],
    ids=["margin 1e9", "reserved slot"],
)
def test_a_header_field_out_of_range_is_refused_before_any_weight_is_written(
    slot, value, message, tmp_path
):
    source = _model().state_dict()
    source["2._extra_state"] = source["2._extra_state"].clone()
    source["2._extra_state"][slot] = value
    path = _save(tmp_path / "ckpt", {"model": source})
    target = _model(seed=1)
    before = _snapshot(target)
    with pytest.raises(ValueError, match=rf"'model\.2\._extra_state': .*{message}"):
        _fastcast_load({"model": target.state_dict()}, path)
    _assert_unchanged(target, before)


def test_an_extra_state_size_beyond_its_stored_bytes_is_not_allocated(tmp_path):
    """A size written into the metadata (2**40 values) is checked against the bytes the
    checkpoint stores for the entry before anything is allocated for it."""
    path = _save(tmp_path / "ckpt", {"model": _model().state_dict()})
    metadata = read_metadata((path / ".metadata").read_bytes(), "good")
    metadata.state_dict_metadata["model.0._extra_state"].size = torch.Size([2**40])
    metadata.state_dict_metadata["model.0._extra_state"].chunks[0].sizes = torch.Size([2**40])
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    target = _model(seed=1)
    before = _snapshot(target)
    with pytest.raises(fastcast.dcp.CheckpointMismatchError, match=r"saved \(1099511627776,\)"):
        _fastcast_load({"model": target.state_dict()}, path)
    _assert_unchanged(target, before)


def test_another_storage_reader_is_refused(tmp_path):
    path = _save(tmp_path / "ckpt", {"model": _model().state_dict()})

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return super().read_metadata(*args, **kwargs)

    with pytest.raises(TypeError, match="Reader reads the checkpoint's metadata in its own way"):
        fastcast.dcp.load(
            {"model": _model().state_dict()}, storage_reader=Reader(path), no_dist=True
        )
