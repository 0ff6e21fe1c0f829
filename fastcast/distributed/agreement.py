"""Whether the ranks of a process group quantize with the same recipe.

The collectives fastcast starts, and the layouts FSDP2 gathers for it, depend on the
recipe: how many there are (current scaling all-reduces an amax where MXFP8 reduces
nothing) and what they carry (codes only, or codes and block scales). Ranks that use
different recipes therefore run mismatched collectives, and would block until the
process group's timeout, then fail with the backend's send/recv error. ``agree`` turns
that into a ``RuntimeError`` on every rank, naming each rank's recipe, from the places
that start such a collective:

- FSDP2's quantized all-gather (``FSDPFloat8Weight.fsdp_pre_all_gather``): the recipe
  each weight was converted for, over the FSDP group;
- a layer's plan for an autocast with an ``amax_reduction_group``: the autocast's recipe,
  over that group;
- tensor and sequence parallelism (``nn.tensor_parallel``): the autocast's recipe, over
  the tensor-parallel group (and the autocast's group, if any).

The check runs once per (process group, recipe): the first time a recipe is used with a
group, each rank all-gathers a 64-bit fingerprint of it (one collective and one host
sync; a second one gathers the recipes' descriptions when they differ). Agreed pairs are
kept in ``runtime.state.agreed_recipes``, keyed weakly by the group, so later calls cost a
dictionary look-up. Recipes compare by value: a new recipe object equal to an agreed one
is not checked again.

What it cannot see: ranks that agree on a recipe at first and later switch to different
ones at different steps (a rank meeting a new recipe runs the check while the other runs
its own collectives). Traced code (``torch.compile``) and CUDA graph captures skip the
check, which needs the host.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from typing import Any

import torch

from ..runtime.state import agreed_recipes

__all__ = ["agree", "describe", "exchange"]


def describe(recipe: Any) -> str:
    """``recipe`` as text that is the same in every process for equal recipes: its
    fields' values, callables by module and qualified name (``repr`` of a recipe names
    them by address, which differs between processes)."""
    if not dataclasses.is_dataclass(recipe):
        return f"{type(recipe).__qualname__}()"
    body = ", ".join(
        f"{f.name}={_value(getattr(recipe, f.name))}" for f in dataclasses.fields(recipe)
    )
    return f"{type(recipe).__qualname__}({body})"


def _value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if callable(value):
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"<{getattr(value, '__module__', '?')}.{name}>"
    return repr(value)


def _fingerprint(recipe: Any, text: str) -> int:
    """A signed 64-bit digest of the recipe's type (with its module) and ``text``."""
    key = f"{type(recipe).__module__}:{text}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little", signed=True)


def exchange(group: Any, recipe: Any, device: torch.device) -> list[str] | None:
    """Every rank's recipe over ``group`` (world size > 1): None when all fingerprints
    are equal, else each group rank's ``describe`` text. Collective: every rank of the
    group calls it, with tensors on ``device`` (one the group's backend serves).

    (``dist.all_gather`` of a list: not the all-gather of fastcast's and FSDP2's data,
    ``all_gather_single``, whose bytes the tests count.)"""
    import torch.distributed as dist  # noqa: PLC0415

    text = describe(recipe)
    data = text.encode()
    world = dist.get_world_size(group)
    mine = torch.tensor([_fingerprint(recipe, text), len(data)], dtype=torch.int64)
    rows = _all_gather(mine.to(device), world, group)  # the host sync, once per pair
    if all(row[0] == rows[0][0] for row in rows):
        return None
    # They differ (every rank sees it): gather the descriptions to name them.
    send = torch.zeros(max(row[1] for row in rows), dtype=torch.uint8)
    send[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    texts = _all_gather(send.to(device), world, group)
    return [bytes(t[:n]).decode(errors="replace") for t, (_, n) in zip(texts, rows)]


def _all_gather(t: torch.Tensor, world: int, group: Any) -> list[list[int]]:
    """Every rank's ``t`` (same shape on all), as lists of ints, by group rank."""
    import torch.distributed as dist  # noqa: PLC0415

    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


def agree(recipe: Any, device: torch.device, what: str, *groups: Any) -> None:
    """Check, once per (group, ``recipe``), that every rank of each of ``groups`` uses
    ``recipe``: a ``RuntimeError`` on every rank of a group naming each rank's recipe if
    not. Give the widest group first (the autocast's, before the tensor-parallel group it
    contains): a refusal there reaches every rank before any rank waits in another check.

    Collective on its first call for a pair: call it where every rank of the group
    reaches it, before the first collective whose layout depends on the recipe, with
    ``device`` one the group's backend serves. ``what`` says what needs the agreement
    (for the message). Not checked: no recipe, a group that is None (nothing reduced) or
    not a ``ProcessGroup``, traced code and CUDA graph captures."""
    if recipe is None:
        return
    for group in groups:
        if group is not None:
            _agree(group, recipe, device, what)


def _agree(group: Any, recipe: Any, device: torch.device, what: str) -> None:
    try:
        agreed = agreed_recipes.get(group)
    except TypeError:  # not weak-referenceable: not a process group
        return
    if agreed is not None and recipe in agreed:
        return
    import torch.distributed as dist  # noqa: PLC0415

    if not isinstance(group, dist.ProcessGroup) or not dist.is_initialized():
        return
    if torch.compiler.is_compiling() or _capturing(device):
        return
    if dist.get_world_size(group) > 1:
        texts = exchange(group, recipe, device)
        if texts is not None:
            ranks = dist.get_process_group_ranks(group)
            named = "; ".join(f"rank {r}: {t}" for r, t in zip(ranks, texts))
            raise RuntimeError(
                f"fastcast: the ranks of a process group (ranks {ranks}) use different "
                f"recipes for {what}, so their collectives would not match (a hang until "
                f"the group's timeout); give every rank the same recipe. {named}"
            )
    agreed_recipes.setdefault(group, set()).add(recipe)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device`` (no host sync allowed)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
