"""Loading ``fc.Linear`` state with torch.distributed.checkpoint (DCP), whatever its layout,
without running anything the checkpoint holds.

DCP loads in place: each tensor of the target state dict must already be there, with the
size that was saved, and DCP reads nothing else. An ``fc.Linear`` has an
``_extra_state`` entry only while it keeps state (DelayedScaling's scales and amax
history, whose size depends on ``amax_history_len``); stateless recipes save plain state
dicts, and earlier fastcast versions saved a 16-value header for them. So a target built
differently from the saver (converted without ``recipe=``, for another recipe, or with
another history length) either fails in DCP ("Size mismatch", "Missing key") or, for a
delayed-scaling checkpoint loaded into a target without extra-state entries, silently
reads no scales.

``load`` is the whole flow, all or nothing::

    import fastcast.dcp

    sd = {"model": model.state_dict()}
    fastcast.dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])

It reads the checkpoint's ``.metadata`` without running it (``SafeFileSystemReader``:
DCP's own reader unpickles it, so a crafted file runs code), then the extra states and
every entry saved as bytes, and validates them (a NaN scale, a pickled extra state
outside ``fc.allow_unsafe_extra_state()``, a header field out of range are refused before
any weight is read into the model: DCP writes the parameters of ``model.state_dict()``
in place), compares every other entry's saved size with the target's (a mismatch is a
``CheckpointMismatchError``, a ``ValueError`` naming each entry), then loads with
``LoadPlanner``. Errors are ordinary exceptions: DCP's own ``CheckpointException``
derives from ``BaseException``, which ``except Exception`` misses; ``load`` raises the
``ValueError`` inside it, or a ``CheckpointLoadError`` (a ``RuntimeError``) for anything
else. A refused ``.metadata`` is a ``CheckpointMetadataError`` (a ``ValueError``).

``LoadPlanner``, for code that calls ``dcp.load`` itself, fits the target's extra-state
entries to the checkpoint before DCP plans its reads (``fit_extra_states``): it sizes
each as saved, adds the ones the checkpoint holds state for (next to a ``weight`` the
target has), and removes the ones the checkpoint has none for; ``load_state_dict`` then
does what it does with a state dict file of that checkpoint (installs the scales, starts
them afresh, or reports the entries as unexpected keys of layers converted for a
stateless recipe: ``fc.Linear._load_from_state_dict``). It reads the extra states before
the other entries of each file, validates each as it is read, and reads entries saved as
bytes with fastcast's restricted unpickler (DCP's planner gives them to
``torch.load(weights_only=False)``). It cannot make the metadata safe: DCP reads it
(``storage_reader.read_metadata()``) before the planner is called, so pass
``storage_reader=SafeFileSystemReader(path)`` with it; with ``checkpoint_id`` alone DCP
makes its own ``FileSystemReader``, whose ``pickle.load`` runs whatever the file holds.
(With the default planner no fastcast code runs inside ``dcp.load``: its mismatches are
DCP's ``CheckpointException``, and scales the target has no entry for are not read.)

This module imports ``torch.distributed.checkpoint``; ``import fastcast`` does not.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from .serialization.dcp_metadata import CheckpointMetadataError, load_entry, read_metadata
from .serialization.extra_state import (
    EXTRA_STATE_KEY,
    decode_extra_state,
    is_extra_state_entry,
)
from .serialization.state_format import HEADER

__all__ = [
    "CheckpointLoadError",
    "CheckpointMetadataError",
    "CheckpointMismatchError",
    "LoadPlanner",
    "SafeFileSystemReader",
    "fit_extra_states",
    "load",
]


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the target state dict: entries of other sizes, or
    entries the checkpoint lacks. Raised before anything is read."""


class CheckpointLoadError(RuntimeError):
    """DCP failed for another reason (its ``CheckpointException`` is the ``__cause__``)."""


_METADATA_FILE = ".metadata"  # DCP's name for it (``__<rank>.metadata`` per rank)


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader``, reading the checkpoint's ``.metadata`` with fastcast's
    restricted unpickler instead of ``pickle.load``: only what DCP's writer pickles (its
    metadata dataclasses, ``torch.Size``, dtypes, plain containers) is read, and anything
    else is refused with a ``CheckpointMetadataError`` describing the file, nothing of it
    run. The rest is ``FileSystemReader``'s (tensors are read with
    ``torch.load(weights_only=True)``). For ``dcp.load`` called directly::

        dcp.load(sd, storage_reader=fastcast.dcp.SafeFileSystemReader(path),
                 planner=fastcast.dcp.LoadPlanner())

    (``LoadPlanner`` reads entries saved as bytes with the restricted unpickler too; DCP's
    default planner gives them to ``torch.load(weights_only=False)``.) A refused global
    ``.metadata`` is refused again when DCP falls back to a rank's own metadata file.
    """

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._refused: str | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._refused = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._refused is not None:
            raise CheckpointMetadataError(self._refused)
        rank = kwargs.get("rank")
        name = _METADATA_FILE if rank is None else f"__{rank}{_METADATA_FILE}"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        try:
            metadata = read_metadata(data, where=str(path))
        except CheckpointMetadataError as exc:
            self._refused = str(exc)
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


def _safe_reader(storage_reader: Any, checkpoint_id: Any) -> SafeFileSystemReader:
    """The reader ``load`` reads with: a ``SafeFileSystemReader`` of ``checkpoint_id``,
    or of the folder (and file system) of a ``FileSystemReader`` it is given."""
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("fastcast.dcp.load: give checkpoint_id or storage_reader")
        return SafeFileSystemReader(checkpoint_id)
    if isinstance(storage_reader, SafeFileSystemReader):
        return storage_reader
    if _reads_as_filesystem(storage_reader):
        # The same reader (its file system, folder, extensions), reading the metadata
        # safely; every other method is FileSystemReader's, the same as the original's.
        safe = SafeFileSystemReader.__new__(SafeFileSystemReader)
        safe.__dict__.update(vars(storage_reader))
        safe._refused = None
        return safe
    raise TypeError(
        f"fastcast.dcp.load: a {type(storage_reader).__qualname__} reads the checkpoint's "
        "metadata in its own way, which fastcast cannot vouch for; fastcast.dcp.load reads "
        "checkpoints of DCP's file-system writer (give checkpoint_id, a FileSystemReader, an "
        "FsspecReader or a fastcast.dcp.SafeFileSystemReader). To load with this reader "
        "anyway, call torch.distributed.checkpoint.load(..., storage_reader=reader, "
        "planner=fastcast.dcp.LoadPlanner()) yourself"
    )


def _reads_as_filesystem(reader: Any) -> bool:
    """Whether every method of ``reader`` is ``FileSystemReader``'s: its class is
    ``FileSystemReader`` or DCP's fsspec reader (which only sets up another file system)."""
    if type(reader) is FileSystemReader:
        return True
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: PLC0415
    except ImportError:  # fsspec is not installed
        return False
    return type(reader) is FsspecReader


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that sizes ``fc.Linear`` extra-state entries as saved, reads
    them before the other entries of each checkpoint file, and refuses one that fastcast
    would refuse to load (a ``ValueError`` naming the entry, inside DCP's
    ``CheckpointException``) as it is read. Entries saved as bytes are read with
    fastcast's restricted unpickler (plain data, tensors and byte buffers), never with
    ``torch.load(weights_only=False)``.

    A planner is called after DCP has read the checkpoint's metadata: pair it with
    ``storage_reader=SafeFileSystemReader(path)`` (module docstring)."""

    def set_up_planner(
        self,
        state_dict: Any,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # The entries that are fc.Linear extra states, before fitting replaces them, and
        # those fitting adds.
        self._fc_extra = {
            fqn for _, _, fqn, value in _entries(state_dict) if is_extra_state_entry(fqn, value)
        }
        if metadata is not None:
            self._fc_extra.update(fit_extra_states(state_dict, metadata))
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        # Storage readers read file by file, each in plan order (FileSystemReader does):
        # extra states first, so that a refused one stops the load before the weights in
        # its file are written. (A stable sort: the rest keeps DCP's order.)
        plan = super().finish_plan(new_plan)
        items = sorted(plan.items, key=lambda item: not _is_extra_item(item))
        return dataclasses.replace(plan, items=items)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        # fastcast's (a target fc.Linear's, or fastcast's by its values); other
        # libraries' left alone.
        if fqn in getattr(self, "_fc_extra", ()) or is_extra_state_entry(fqn, tensor):
            decode_extra_state(tensor, owner=f"checkpoint entry {fqn!r}")
        super().commit_tensor(read_item, tensor)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_entry(value.read(), f"checkpoint entry {fqn!r}")
        if fqn in getattr(self, "_fc_extra", ()):  # TransformerEngine's form, say
            decode_extra_state(loaded, owner=f"checkpoint entry {fqn!r}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _is_extra_item(item: ReadItem) -> bool:
    """Whether ``item`` is read into an ``_extra_state`` entry (anyone's: only the
    order of reads depends on it)."""
    return item.dest_index.fqn.rsplit(".", 1)[-1] == EXTRA_STATE_KEY


def _entries(state_dict: MutableMapping[str, Any]) -> Iterator[tuple[Any, str, str, Any]]:
    """``(mapping, key, fqn, value)`` of every leaf of a nested state dict, keys joined by
    "." as DCP flattens them."""

    def visit(mapping: MutableMapping[str, Any], prefix: str) -> Iterator[Any]:
        for key, value in list(mapping.items()):
            fqn = f"{prefix}{key}"
            if isinstance(value, MutableMapping):
                yield from visit(value, f"{fqn}.")
            else:
                yield mapping, key, fqn, value

    return visit(state_dict, "")


def _flattened(state_dict: MutableMapping[str, Any]) -> dict[str, Any]:
    """Every entry DCP reads, by the key it reads it under: mappings and lists (an
    optimizer's parameter groups) flattened as DCP flattens them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415

    return flatten_state_dict(state_dict)[0]


def _saved_extra_state(metadata: Metadata, fqn: str) -> Any:
    """An empty stand-in of what the checkpoint saved at ``fqn``, an extra state, to read
    it into: a tensor of the saved dtype and size, ``b""`` for bytes (TransformerEngine
    saves pickles), or None when there is nothing to read (no such entry, or a saved
    tensor larger than the bytes stored for it: a size written into the metadata must
    not make fastcast allocate it)."""
    entry = metadata.state_dict_metadata.get(fqn)
    if isinstance(entry, BytesStorageMetadata):
        return b""
    if not isinstance(entry, TensorStorageMetadata):
        return None
    dtype = entry.properties.dtype
    nbytes = math.prod(entry.size) * dtype.itemsize
    held = _stored_bytes(metadata, fqn, entry)
    if held is not None and nbytes > held:
        return None
    return torch.empty(entry.size, dtype=dtype)


def _stored_bytes(metadata: Metadata, fqn: str, entry: TensorStorageMetadata) -> int | None:
    """How many bytes the checkpoint's files hold for ``fqn`` (its chunks' lengths, which
    include the ``torch.save`` archive around the values), or None where the reader's
    storage data does not say."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return None
    total = 0
    for chunk in entry.chunks:
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        length = getattr(info, "length", None)
        if type(length) is not int:
            return None if info is not None else 0
        total += length
    return total


def fit_extra_states(state_dict: MutableMapping[str, Any], metadata: Metadata) -> list[str]:
    """Fit, in place, the ``fc.Linear`` extra-state entries of ``state_dict`` (nested
    mappings, as DCP flattens them: keys joined by ".") to the checkpoint ``metadata``
    describes; return the fqns changed:

    - an entry saved with another size or dtype becomes an empty tensor of the saved ones;
    - an entry the checkpoint lacks (a plain checkpoint, or one of a stateless recipe) is
      removed: ``load_state_dict`` then starts that layer's scales afresh;
    - a state the checkpoint holds (more than the 16-value stateless header an earlier
      fastcast saved), next to a ``weight`` of the target that has no entry, is added as
      an empty tensor of the saved size.

    Entries that are not fastcast's, and extra states saved as bytes (which DCP reads
    whatever the target), are left to DCP."""
    changed = []
    for action, mapping, key, fqn, placeholder in _fits(state_dict, metadata):
        if action == "remove":
            del mapping[key]
        else:
            mapping[key] = placeholder
        changed.append(fqn)
    return changed


def _fits(state_dict: MutableMapping[str, Any], metadata: Metadata) -> list[tuple[Any, ...]]:
    """What ``fit_extra_states`` changes: ``(action, mapping, key, fqn, placeholder)`` per
    entry, ``action`` one of "resize", "remove", "add"; changes nothing."""
    fits = []
    for mapping, key, fqn, value in _entries(state_dict):
        if is_extra_state_entry(fqn, value):
            if fqn not in metadata.state_dict_metadata:
                fits.append(("remove", mapping, key, fqn, None))
                continue
            saved = _saved_extra_state(metadata, fqn)
            if isinstance(saved, torch.Tensor) and (
                saved.shape != value.shape or saved.dtype != value.dtype
            ):
                fits.append(("resize", mapping, key, fqn, saved))
        elif key == "weight" or key.endswith(".weight"):
            extra_key = key[: -len("weight")] + EXTRA_STATE_KEY
            extra_fqn = fqn[: -len("weight")] + EXTRA_STATE_KEY
            if extra_key in mapping:
                continue
            saved = _saved_extra_state(metadata, extra_fqn)
            if (
                isinstance(saved, torch.Tensor)
                and saved.dtype == torch.float32
                and saved.dim() == 1
                and saved.shape[0] > HEADER
            ):
                fits.append(("add", mapping, extra_key, extra_fqn, saved))
    return fits


def load(
    state_dict: MutableMapping[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_reader: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
) -> None:
    """``torch.distributed.checkpoint.load`` of ``state_dict`` (in place), all or nothing
    for the model whose tensors it holds (module docstring): the metadata is read without
    running it, the extra states and every entry saved as bytes are read and validated
    first, the other entries' sizes checked against the checkpoint, and only then is
    anything written. Refusals are ``ValueError`` (a ``CheckpointMetadataError`` for the
    metadata, a ``CheckpointMismatchError`` for sizes), naming the entries; other DCP
    failures a ``CheckpointLoadError``.

    ``checkpoint_id``, ``storage_reader``, ``process_group`` and ``no_dist`` are
    ``dcp.load``'s; a ``storage_reader`` is a ``FileSystemReader`` (its metadata is then
    read as ``SafeFileSystemReader`` reads it), an fsspec reader or a
    ``SafeFileSystemReader``: another reader's way of reading the metadata is not
    fastcast's to vouch for (a ``TypeError``). Called by every rank, as ``dcp.load`` is.
    """
    reader = _safe_reader(storage_reader, checkpoint_id)
    kwargs = {
        "checkpoint_id": checkpoint_id,
        "storage_reader": reader,
        "process_group": process_group,
        "no_dist": no_dist,
    }
    if checkpoint_id is not None:
        reader.reset(checkpoint_id)
    metadata = reader.read_metadata()

    # 1. Sizes: every entry but the extra states (read as saved) and the entries saved
    # as bytes (read whatever the target holds).
    saved = metadata.state_dict_metadata
    problems = []
    first: dict[str, Any] = {}  # read and validated before anything else
    extra: list[str] = []  # the fc.Linear extra states among them
    fits = {fqn: (action, held) for action, _, _, fqn, held in _fits(state_dict, metadata)}
    for fqn, (action, held) in fits.items():
        if action == "add":  # a saved state the target has no entry for yet
            first[fqn] = held
            extra.append(fqn)
    for fqn, value in _flattened(state_dict).items():
        entry = saved.get(fqn)
        if is_extra_state_entry(fqn, value):
            if fits.get(fqn, ("",))[0] == "remove":  # nothing saved: starts afresh
                continue
            placeholder = _saved_extra_state(metadata, fqn)
            if placeholder is not None:
                first[fqn] = placeholder
                extra.append(fqn)
                continue
        if entry is None:
            problems.append(f"{fqn!r}: not in the checkpoint")
        elif isinstance(entry, BytesStorageMetadata):
            if isinstance(value, torch.Tensor):
                problems.append(f"{fqn!r}: saved as bytes, target a tensor")
            else:
                first[fqn] = b""
        elif isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata):
            if tuple(entry.size) != tuple(value.shape):
                problems.append(f"{fqn!r}: saved {tuple(entry.size)}, target {tuple(value.shape)}")
    if problems:
        shown = "; ".join(problems[:10])
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointMismatchError(
            f"fastcast.dcp.load: the checkpoint does not fit the state dict ({shown}{more}). "
            "Build the model with the configuration it was saved with; fc.Linear extra "
            "states of any size load by themselves (fastcast.dcp.LoadPlanner fits them)."
        )
    # 2. The extra states and the entries saved as bytes alone, into objects of their own,
    # validated before anything of the model is written (the planner refuses a bytes
    # entry that imports anything but plain data, tensors and byte buffers).
    if first:
        _dcp_load(first, LoadPlanner(), kwargs)
        for fqn in extra:
            decode_extra_state(first[fqn], owner=f"checkpoint entry {fqn!r}")
    # 3. Everything.
    _dcp_load(state_dict, LoadPlanner(), kwargs)


def _dcp_load(state_dict: Any, planner: DefaultLoadPlanner, kwargs: dict[str, Any]) -> None:
    """``dcp.load``, its ``CheckpointException`` (a ``BaseException``) turned into the
    ``ValueError`` a planner raised inside it, or into a ``CheckpointLoadError``."""
    try:
        dist_cp.load(state_dict, planner=planner, **kwargs)
    except CheckpointException as exc:
        causes = [failure[0] for failure in exc.failures.values()]
        refused = [c for c in causes if isinstance(c, ValueError)]
        if refused:
            raise refused[0] from exc
        raise CheckpointLoadError(
            f"fastcast.dcp.load: DCP failed: {'; '.join(map(str, causes))}"
        ) from exc
