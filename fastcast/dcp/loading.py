"""``fastcast.dcp.load``: all or nothing. Sizes are checked and the extra states and byte
entries read and validated before anything of the model is written; DCP's
``CheckpointException`` (a ``BaseException``) comes out as an ordinary exception.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..serialization.extra_state import decode_extra_state, is_extra_state_entry
from .fitting import _fits, _saved_extra_state
from .planner import LoadPlanner
from .reader import _safe_reader


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the target state dict: entries of other sizes, or
    entries the checkpoint lacks. Raised before anything is read."""


class CheckpointLoadError(RuntimeError):
    """DCP failed for another reason (its ``CheckpointException`` is the ``__cause__``)."""


def _flattened(state_dict: MutableMapping[str, Any]) -> dict[str, Any]:
    """Every entry DCP reads, by the key it reads it under: mappings and lists (an
    optimizer's parameter groups) flattened as DCP flattens them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415

    return flatten_state_dict(state_dict)[0]


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
