"""The ``_extra_state`` codec: plain tensors and primitives; a pickle only when asked.

Stateless recipes store nothing (``None``). Delayed scaling stores, per direction, the
amax history and scales as tensors, so a checkpoint loads with
``torch.load(weights_only=True, mmap=True)``.

A pickled payload offered to a module (``bytes``, ``bytearray``, ``io.BytesIO`` or a
uint8 tensor: the forms TransformerEngine stores its extra state in) is refused with a
description of what it would import, found by reading the pickle's opcodes without
executing them. Only inside ``fc.allow_unsafe_extra_state()`` is it unpickled; what comes
out is then loaded if it is fastcast's own state or TransformerEngine's delayed-scaling
state (see ``from_transformer_engine``), and is an error otherwise. An empty payload
is TransformerEngine's way of saying "no FP8 state": there is nothing to unpickle, so it
loads as stateless in or out of the block.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from .delayed import BACKWARD, FORWARD, ScalingMeta
from .pickles import describe_pickle, payload_bytes, unpickle
from .state import unsafe_extra_state
from .te_state import TE_KEYS, describe_items, from_transformer_engine, hashable

FORMAT = "fastcast.extra_state"
VERSION = 1
_DIRECTIONS = {"forward": FORWARD, "backward": BACKWARD}


class allow_unsafe_extra_state:  # noqa: N801 - lower case like fc.autocast
    """Allow modules in this thread to unpickle a foreign extra state (and so run its code).

    ::

        with fc.allow_unsafe_extra_state():
            model.load_state_dict(torch.load(path, weights_only=False))

    Without it, a pickled ``_extra_state`` (TransformerEngine's format, say) is refused.
    Only use it for files you trust: unpickling can execute arbitrary code. fastcast's own
    state never needs it.

    The permission follows ``contextvars``, as ``fc.autocast`` does: it covers the code
    run in this context while the block is open, including asyncio tasks created and
    ``asyncio.to_thread`` / ``copy_context().run`` calls made inside it; other threads,
    tasks created elsewhere (even while the block is suspended at an ``await``) never see
    it. Blocks nest, the same instance may be entered again while active, and each exit
    (exceptions included) takes back exactly what its entry gave.
    """

    __slots__ = ()

    def __enter__(self) -> allow_unsafe_extra_state:
        unsafe_extra_state.set(unsafe_extra_state.get() + 1)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        unsafe_extra_state.set(max(0, unsafe_extra_state.get() - 1))


def encode_extra_state(metas: dict[int, ScalingMeta]) -> dict[str, Any] | None:
    """The module's delayed-scaling state as a dict of tensors, or None when stateless."""
    if not metas:
        return None
    state: dict[str, Any] = {"format": FORMAT, "version": VERSION, "kind": "delayed_scaling"}
    for name, direction in _DIRECTIONS.items():
        if direction in metas:
            state[name] = metas[direction].state()
    return state


def decode_extra_state(state: Any, owner: str = "module") -> dict[int, ScalingMeta]:
    """Metas from ``encode_extra_state``'s output; a clear error for anything else.

    A pickled payload is unpickled only inside ``allow_unsafe_extra_state``.
    """
    if state is None:
        return {}
    if _is_own(state):
        return _decode_own(state, owner)
    if isinstance(state, (bytes, bytearray, io.BytesIO)) or (
        isinstance(state, torch.Tensor) and state.dtype == torch.uint8
    ):
        data = payload_bytes(state)
        if not data:
            return {}
        if unsafe_extra_state.get() <= 0:
            raise ValueError(
                f"{owner}: refusing a pickled extra state ({describe_pickle(data)}); fastcast "
                "does not unpickle checkpoint state unless asked to. It most likely comes "
                "from another FP8 library (TransformerEngine stores its scales this way). To "
                "start the scales afresh, drop the '_extra_state' entries and load with "
                "strict=False; if you trust the file, load it inside "
                "`with fc.allow_unsafe_extra_state():`, which unpickles it (running any code "
                "it holds) and converts TransformerEngine's delayed-scaling state."
            )
        return _decode_unpickled(unpickle(data, owner), owner)
    raise ValueError(f"{owner}: unrecognised extra state of type {type(state).__name__}")


def _is_own(state: Any) -> bool:
    return isinstance(state, dict) and state.get("format") == FORMAT


def _decode_own(state: dict[str, Any], owner: str) -> dict[int, ScalingMeta]:
    if state.get("version") != VERSION or state.get("kind") != "delayed_scaling":
        raise ValueError(
            f"{owner}: unsupported fastcast extra state version={state.get('version')!r} "
            f"kind={state.get('kind')!r} (this fastcast reads version {VERSION})"
        )
    metas = {}
    for name, direction in _DIRECTIONS.items():
        if name in state:
            part = state[name]
            keys = ("amax_history", "scale")
            if not isinstance(part, dict) or not all(
                isinstance(part.get(k), torch.Tensor) for k in keys
            ):
                raise ValueError(f"{owner}: extra state '{name}' must hold tensors")
            metas[direction] = ScalingMeta.from_state(part)
    return metas


def _decode_unpickled(obj: Any, owner: str) -> dict[int, ScalingMeta]:
    """Metas from what an opted-in unpickling produced."""
    if obj is None:  # older TransformerEngine saved None for a module without FP8 state
        return {}
    if _is_own(obj):
        return _decode_own(obj, owner)
    if isinstance(obj, dict) and any(hashable(k) and k in TE_KEYS for k in obj):
        return from_transformer_engine(obj, owner)
    if isinstance(obj, dict):
        raise ValueError(
            f"{owner}: the unpickled extra state is a dict that is neither fastcast's nor "
            f"TransformerEngine's: {describe_items(obj)}"
        )
    raise ValueError(
        f"{owner}: the unpickled extra state is a {type(obj).__module__}.{type(obj).__qualname__}"
        ", neither fastcast's state nor TransformerEngine's"
    )
