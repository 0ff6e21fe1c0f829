"""Fitting a target state dict's ``fc.Linear`` extra-state entries to what a checkpoint
saved (DCP loads in place: each entry must exist with the saved size), from the metadata
alone: no size it claims is allocated beyond the bytes stored for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..serialization.extra_state import EXTRA_STATE_KEY, is_extra_state_entry
from ..serialization.state_format import HEADER


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
