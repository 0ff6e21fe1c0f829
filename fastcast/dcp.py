"""Loading ``fc.Linear`` state with torch.distributed.checkpoint (DCP), whatever its layout.

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

It reads the checkpoint's extra states first and validates them (a NaN scale is refused
before any weight is read into the model: DCP writes the parameters of
``model.state_dict()`` in place), compares every other entry's saved size with the
target's (a mismatch is a ``CheckpointMismatchError``, a ``ValueError`` naming each
entry), then loads with ``LoadPlanner``. Errors are ordinary exceptions: DCP's own
``CheckpointException`` derives from ``BaseException``, which ``except Exception``
misses; ``load`` raises the ``ValueError`` inside it, or a ``CheckpointLoadError``
(a ``RuntimeError``) for anything else.

``LoadPlanner``, for code that calls ``dcp.load`` itself, fits the target's extra-state
entries to the checkpoint before DCP plans its reads (``fit_extra_states``): it sizes
each as saved, adds the ones the checkpoint holds state for (next to a ``weight`` the
target has), and removes the ones the checkpoint has none for; ``load_state_dict`` then
does what it does with a state dict file of that checkpoint (installs the scales, starts
them afresh, or reports the entries as unexpected keys of layers converted for a
stateless recipe: ``fc.Linear._load_from_state_dict``). It reads the extra states before
the other entries of each file, and validates each as it is read. (With the default
planner no fastcast code runs inside ``dcp.load``: its mismatches are DCP's
``CheckpointException``, and scales the target has no entry for are not read.)

This module imports ``torch.distributed.checkpoint``; ``import fastcast`` does not.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from .serialization.extra_state import (
    EXTRA_STATE_KEY,
    decode_extra_state,
    is_extra_state_entry,
)
from .serialization.state_format import HEADER

__all__ = [
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "LoadPlanner",
    "fit_extra_states",
    "load",
]


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the target state dict: entries of other sizes, or
    entries the checkpoint lacks. Raised before anything is read."""


class CheckpointLoadError(RuntimeError):
    """DCP failed for another reason (its ``CheckpointException`` is the ``__cause__``)."""


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that sizes ``fc.Linear`` extra-state entries as saved, reads
    them before the other entries of each checkpoint file, and refuses one that fastcast
    would refuse to load (a ``ValueError`` naming the entry, inside DCP's
    ``CheckpointException``) as it is read."""

    def set_up_planner(
        self,
        state_dict: Any,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is not None:
            fit_extra_states(state_dict, metadata)
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
        if is_extra_state_entry(fqn, tensor):  # fastcast's (other libraries' left alone)
            decode_extra_state(tensor, owner=f"checkpoint entry {fqn!r}")
        super().commit_tensor(read_item, tensor)


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


def _saved_extra_size(metadata: Metadata, fqn: str) -> torch.Size | None:
    """The saved size of the extra state at ``fqn``, if it was saved as fastcast saves
    one (a 1-D float32 tensor)."""
    entry = metadata.state_dict_metadata.get(fqn)
    if (
        isinstance(entry, TensorStorageMetadata)
        and entry.properties.dtype == torch.float32
        and len(entry.size) == 1
    ):
        return entry.size
    return None


def fit_extra_states(state_dict: MutableMapping[str, Any], metadata: Metadata) -> list[str]:
    """Fit, in place, the ``fc.Linear`` extra-state entries of ``state_dict`` (nested
    mappings, as DCP flattens them: keys joined by ".") to the checkpoint ``metadata``
    describes; return the fqns changed:

    - an entry saved with another size becomes an empty float32 tensor of the saved size;
    - an entry the checkpoint lacks (a plain checkpoint, or one of a stateless recipe) is
      removed: ``load_state_dict`` then starts that layer's scales afresh;
    - a state the checkpoint holds (more than the 16-value stateless header an earlier
      fastcast saved), next to a ``weight`` of the target that has no entry, is added as
      an empty tensor of the saved size.

    Entries that are not fastcast's, or that were saved as anything but a 1-D float32
    tensor, are left to DCP."""
    changed = []
    for action, mapping, key, fqn, size in _fits(state_dict, metadata):
        if action == "remove":
            del mapping[key]
        else:
            mapping[key] = torch.empty(size, dtype=torch.float32)
        changed.append(fqn)
    return changed


def _fits(state_dict: MutableMapping[str, Any], metadata: Metadata) -> list[tuple[Any, ...]]:
    """What ``fit_extra_states`` changes: ``(action, mapping, key, fqn, size)`` per entry,
    ``action`` one of "resize", "remove", "add"; changes nothing."""
    fits = []
    for mapping, key, fqn, value in _entries(state_dict):
        if is_extra_state_entry(fqn, value):
            size = _saved_extra_size(metadata, fqn)
            if fqn not in metadata.state_dict_metadata:
                fits.append(("remove", mapping, key, fqn, None))
            elif size is not None and size != value.shape:
                fits.append(("resize", mapping, key, fqn, size))
        elif key == "weight" or key.endswith(".weight"):
            extra_key = key[: -len("weight")] + EXTRA_STATE_KEY
            extra_fqn = fqn[: -len("weight")] + EXTRA_STATE_KEY
            size = _saved_extra_size(metadata, extra_fqn)
            if extra_key not in mapping and size is not None and size[0] > HEADER:
                fits.append(("add", mapping, extra_key, extra_fqn, size))
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
    for the model whose tensors it holds (module docstring): the extra states are read and
    validated first, the other entries' sizes checked against the checkpoint, and only
    then is anything written. Refusals are ``ValueError`` (a ``CheckpointMismatchError``
    for sizes), naming the entries; other DCP failures a ``CheckpointLoadError``.

    ``checkpoint_id``, ``storage_reader``, ``process_group`` and ``no_dist`` are
    ``dcp.load``'s. Called by every rank, as ``dcp.load`` is.
    """
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("fastcast.dcp.load: give checkpoint_id or storage_reader")
        storage_reader = FileSystemReader(checkpoint_id)
    kwargs = {
        "checkpoint_id": checkpoint_id,
        "storage_reader": storage_reader,
        "process_group": process_group,
        "no_dist": no_dist,
    }
    if checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)
    metadata = storage_reader.read_metadata()

    # 1. Sizes: every entry but the extra states (which LoadPlanner fits) as saved.
    saved = metadata.state_dict_metadata
    problems = []
    extra: dict[str, torch.Tensor] = {}
    fits = {fqn: (action, size) for action, _, _, fqn, size in _fits(state_dict, metadata)}
    for fqn, (action, size) in fits.items():
        if action == "add":
            extra[fqn] = torch.empty(size, dtype=torch.float32)
    for _, _, fqn, value in _entries(state_dict):
        if is_extra_state_entry(fqn, value):
            size = _saved_extra_size(metadata, fqn)
            if fqn in fits and fits[fqn][0] == "remove":
                continue
            if size is not None:
                extra[fqn] = torch.empty(size, dtype=torch.float32)
                continue
        entry = saved.get(fqn)
        if entry is None:
            problems.append(f"{fqn!r}: not in the checkpoint")
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
    # 2. The extra states alone, into tensors of their own, validated before anything
    # of the model is written.
    if extra:
        _dcp_load(extra, DefaultLoadPlanner(), kwargs)
        for fqn, state in extra.items():
            decode_extra_state(state, owner=f"checkpoint entry {fqn!r}")
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
