"""``LoadPlanner``: DCP's default planner with extra states fitted, read first and
validated, and byte entries read by the restricted unpickler.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from ..serialization.dcp_metadata import load_entry
from ..serialization.extra_state import (
    EXTRA_STATE_KEY,
    decode_extra_state,
    is_extra_state_entry,
)
from .fitting import _entries, fit_extra_states


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that sizes ``fc.Linear`` extra-state entries as saved, reads
    them before the other entries of each checkpoint file, and refuses one that fastcast
    would refuse to load (a ``ValueError`` naming the entry, inside DCP's
    ``CheckpointException``) as it is read. Entries saved as bytes are read with
    fastcast's restricted unpickler (plain data, tensors and byte buffers), never with
    ``torch.load(weights_only=False)``.

    A planner is called after DCP has read the checkpoint's metadata: pair it with
    ``storage_reader=SafeFileSystemReader(path)`` (``fastcast.dcp``)."""

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
