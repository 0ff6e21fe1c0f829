"""Loading ``fc.Linear`` state with torch.distributed.checkpoint (DCP), whatever its size.

DCP loads in place: each tensor of the target state dict must already have the size that
was saved. An ``fc.Linear``'s ``_extra_state`` has a size that depends on its state (the
16-value stateless header, or header + scales + amax history of a DelayedScaling run with
some ``amax_history_len``), so a target built differently (converted without
``recipe=``, or with another history length) fails with DCP's "Size mismatch" error.
``LoadPlanner`` replaces each such entry of the target by an empty tensor of the saved
size before DCP plans its reads; ``load_state_dict`` then decodes, validates and installs
the saved state (and a later run under another history length refits it)::

    import fastcast.dcp

    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=path, planner=fastcast.dcp.LoadPlanner())
    model.load_state_dict(sd["model"])

This module imports ``torch.distributed.checkpoint``; ``import fastcast`` does not.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .checkpoint import is_extra_state_entry

__all__ = ["LoadPlanner", "fit_extra_states"]


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that sizes ``fc.Linear`` extra-state entries as saved."""

    def set_up_planner(
        self,
        state_dict: Any,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is not None:
            fit_extra_states(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def fit_extra_states(state_dict: MutableMapping[str, Any], metadata: Metadata) -> list[str]:
    """Replace, in place, every ``fc.Linear`` extra state of ``state_dict`` (nested
    mappings, as DCP flattens them: keys joined by ".") whose saved size differs by an
    empty float32 tensor of the saved size; return the keys replaced. Entries that are not
    fastcast's, or that were saved as anything but a float32 tensor, are left to DCP."""
    saved = metadata.state_dict_metadata
    replaced = []

    def visit(mapping: MutableMapping[str, Any], prefix: str) -> None:
        for key, value in list(mapping.items()):
            fqn = f"{prefix}{key}"
            if isinstance(value, MutableMapping):
                visit(value, f"{fqn}.")
                continue
            if not is_extra_state_entry(fqn, value):
                continue
            entry = saved.get(fqn)
            if (
                isinstance(entry, TensorStorageMetadata)
                and entry.properties.dtype == torch.float32
                and len(entry.size) == 1
                and entry.size != value.shape
            ):
                mapping[key] = torch.empty(entry.size, dtype=torch.float32)
                replaced.append(fqn)

    visit(state_dict, "")
    return replaced
