"""The ``_extra_state`` codec: one float32 tensor per module; a pickle only when asked.

``fc.Linear.get_extra_state()`` always returns a 1-D float32 tensor, so a state dict
holds only tensors (safetensors, ``torch.load(weights_only=True, mmap=True)``, DCP and
Hugging Face ``save_pretrained`` all take it). Layout, version 2 (integers stored exactly
as float32)::

    [0]  MAGIC (16557424 = 0xFCA570)     [2]  kind: 0 stateless, else the scheme's
    [1]  version (2)                     [3]  header length H (16)
    [4..15] the kind's fields; then the kind's values

This module owns the container; what a kind's fields and values mean, and how they are
validated and loaded, is the ``StateFormat`` its scheme registers (``state_format.py``):
kind 1, delayed scaling, is ``fastcast.schemes.delayed.saved_state``, which documents
its layout. A stateless module stores the header alone (kind 0), so a state dict's
layout does not depend on whether the module has run under a stateless recipe. Version 1
(a dict of strings, ints and tensors, or None) still loads.

Every state is validated before anything is loaded: a dense tensor with values (not on
the meta device, not sparse or nested); a known header; then the kind's own checks.
``fc.Linear`` decodes its state before writing its parameters, and every module that
holds an ``fc.Linear`` (a model built from them, or one ``fc.convert`` converted) has a
load pre-hook that validates every ``fc.Linear``'s state before the first parameter is
written, so a refused load changes nothing
(``fastcast.nn.linear_state.validate_extra_states``).

A pickled payload offered to a module (``bytes``, ``bytearray``, ``io.BytesIO`` or a
uint8 tensor: the forms TransformerEngine stores its extra state in) is refused with a
description of what it would import, found by reading the pickle's opcodes without
executing them. Only inside ``fc.allow_unsafe_extra_state()`` is it unpickled, with a
restricted unpickler that builds only tensors, containers and TransformerEngine's recipe
classes (as inert stand-ins) and refuses any other global; what comes out is then loaded
if it is fastcast's own state or a foreign state a registered format converts
(TransformerEngine's delayed scaling: ``fastcast.schemes.delayed.te_state``), and is an
error otherwise. An empty payload is TransformerEngine's way of saying "no FP8 state":
it loads as stateless in or out of the block.
"""

from __future__ import annotations

import io
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from ..runtime.state import UnsafeExtraState, unsafe_extra_state_allowed
from .pickle_model import describe_pickle, payload_bytes
from .state_format import (
    HEADER,
    MAGIC,
    STATELESS,
    VERSION,
    check_holds,
    check_readable,
    format_of_kind,
    format_of_name,
    format_of_state,
    formats,
)
from .transformer_engine import TE_ALLOW_LIST, describe_items
from .unpickling import unpickle

EXTRA_STATE_KEY = "_extra_state"  # nn.Module's name for it in state dicts
_STATELESS_HEADER = [float(MAGIC), float(VERSION), float(STATELESS), float(HEADER)] + [0.0] * (
    HEADER - 4
)
# Header slots of the codec's own (4..15 are the kind's).
_KIND, _HEADER_LEN = 2, 3
# Version 1: a dict, or None when stateless.
_V1_FORMAT = "fastcast.extra_state"
_V1_KEYS = ("format", "version", "kind")


class allow_unsafe_extra_state(UnsafeExtraState):  # noqa: N801 - lower case like fc.autocast
    """Allow modules in this context to unpickle a foreign extra state (TransformerEngine's).

    ::

        with fc.allow_unsafe_extra_state():
            model.load_state_dict(torch.load(path, weights_only=False))

    Without it, a pickled ``_extra_state`` (TransformerEngine's format, say) is refused.
    Inside it, the payload is unpickled by a restricted unpickler that builds only what
    TransformerEngine's extra state needs (containers, tensors and storages, a nested
    weights-only archive, inert stand-ins for its recipe classes) and refuses any other
    global by name, so no payload runs code either way; still, load only files you trust.
    fastcast's own state never needs it.

    The permission follows ``contextvars``, as ``fc.autocast`` does: it covers the code
    run in this context while the block is open, including asyncio tasks created and
    ``asyncio.to_thread`` / ``copy_context().run`` calls made inside it; other threads,
    tasks created elsewhere (even while the block is suspended at an ``await``) never see
    it. Blocks nest, the same instance may be entered again while active, and each exit
    (exceptions included) takes back exactly what its entry gave, in every context that
    saw it, even when a generator holding the block is closed from another context.
    """

    __slots__ = ()


def encode_extra_state(module_state: dict[Any, Any]) -> torch.Tensor:
    """A module's state (``module_state``: key -> ``ModuleState``) as a new float32 CPU
    tensor (layout in the module docstring; the kind's part by its ``StateFormat``)."""
    if not module_state:
        return torch.tensor(_STATELESS_HEADER)
    fmt = format_of_state(module_state)
    if fmt is None:
        # Per-module state no registered format saves: never drop it.
        known = ", ".join(f.name for f in formats())
        raise ValueError(
            "fc.Linear holds per-module state that fastcast's checkpoint format does not "
            f"know ({sorted(map(repr, module_state))}); only the states of registered "
            f"formats ({known}) can be saved, one kind per module"
        )
    fields, values = fmt.encode(module_state)
    header = list(_STATELESS_HEADER)
    header[_KIND] = float(fmt.kind)
    for slot, value in fields.items():
        if not 4 <= slot < HEADER:
            raise ValueError(f"{type(fmt).__name__}: header slot {slot} is not the kind's")
        header[slot] = float(value)
    return torch.cat([torch.tensor(header), *values])


def decode_extra_state(state: Any, owner: str = "module") -> dict[Any, Any]:
    """The module state (on the CPU) of any state fastcast can load; a ValueError naming
    ``owner`` and the problem for anything else. Never changes anything: callers install
    the result.

    A pickled payload is unpickled only inside ``allow_unsafe_extra_state``.
    """
    if state is None:  # version 1, stateless
        return {}
    if isinstance(state, torch.Tensor):
        check_readable(state, owner, "extra state")
    if isinstance(state, torch.Tensor) and state.dtype != torch.uint8:
        return _decode_tensor(state, owner)
    if _is_v1(state):
        return _decode_v1(state, owner)
    if isinstance(state, (bytes, bytearray, io.BytesIO, torch.Tensor)):  # uint8 tensor
        data = payload_bytes(state)
        if not data:
            return {}
        if not unsafe_extra_state_allowed():
            described = describe_pickle(data, TE_ALLOW_LIST)
            raise ValueError(
                f"{owner}: refusing a pickled extra state ({described}); fastcast "
                "does not unpickle checkpoint state unless asked to. It most likely comes "
                "from another FP8 library (TransformerEngine stores its scales this way). To "
                "start the scales afresh, drop it (fc.strip_extra_state(state_dict)) and "
                "load with strict=False; if you trust the file, load it inside "
                "`with fc.allow_unsafe_extra_state():`, which unpickles it with a restricted "
                "unpickler (tensors, containers and TransformerEngine's recipe classes only) "
                "and converts TransformerEngine's delayed-scaling state."
            )
        return _decode_unpickled(unpickle(data, owner, TE_ALLOW_LIST), owner)
    raise ValueError(f"{owner}: unrecognised extra state of type {type(state).__name__}")


def _decode_tensor(state: torch.Tensor, owner: str) -> dict[Any, Any]:
    """Version 2: the container's header checked here, the kind's part by its format."""

    def refuse(problem: str) -> ValueError:
        return ValueError(f"{owner}: {problem}")

    check_holds(state, owner, "extra state")
    if state.dtype != torch.float32 or state.dim() != 1 or state.numel() < 4:
        raise refuse(
            f"extra state is a {state.dtype} tensor of shape {tuple(state.shape)}; fastcast's "
            "is a 1-D float32 tensor (was the state dict cast to another dtype?)"
        )
    flat = state.detach().cpu()
    raw = flat[:HEADER].tolist()  # one read for the whole header
    if raw == _STATELESS_HEADER and flat.numel() == HEADER:
        return {}
    if raw[0] != MAGIC:
        raise refuse(f"extra state tensor is not fastcast's (first value {raw[0]!r})")
    version = raw[1]
    if version != VERSION:
        raise refuse(
            f"unsupported fastcast extra state version {version!r} (this fastcast reads "
            f"versions 1 and {VERSION}; a newer fastcast wrote it?)"
        )
    if len(raw) < HEADER:
        raise refuse(f"fastcast extra state header is truncated ({flat.numel()} values)")
    if raw[_HEADER_LEN] != HEADER:
        raise refuse(
            f"fastcast extra state header length field is {raw[_HEADER_LEN]}, not {HEADER}"
        )
    odd = [(i, v) for i, v in enumerate(raw) if not (math.isfinite(v) and v == int(v))]
    if odd:
        raise refuse(
            f"fastcast extra state header must hold integers; slot {odd[0][0]} holds {odd[0][1]}"
        )
    head = [int(v) for v in raw]
    kind = head[_KIND]
    if kind == STATELESS:
        raise refuse(
            f"stateless fastcast extra state must be exactly the {HEADER}-value header "
            f"(zeros after the first four), got {flat.numel()} values"
        )
    fmt = format_of_kind(kind)
    if fmt is None:
        raise refuse(f"unknown fastcast extra state kind {kind}")
    return fmt.decode(head, flat[HEADER:], owner)


def _is_v1(state: Any) -> bool:
    return isinstance(state, dict) and state.get("format") == _V1_FORMAT


def _decode_v1(state: dict[str, Any], owner: str) -> dict[Any, Any]:
    """Version 1: ``{"format", "version": 1, "kind", <one entry per module-state key, named
    by the kind's format>}``; its format loads the entries."""
    fmt = format_of_name(state.get("kind"))
    if state.get("version") != 1 or fmt is None or not fmt.version_1_names:
        raise ValueError(
            f"{owner}: unsupported fastcast extra state version={state.get('version')!r} "
            f"kind={state.get('kind')!r} (this fastcast reads versions 1 and {VERSION})"
        )
    names = fmt.version_1_names
    unknown = set(state) - {*_V1_KEYS, *names.values()}
    if unknown:
        raise ValueError(f"{owner}: fastcast extra state with unknown keys {sorted(unknown)}")
    parts = {key: state[name] for key, name in names.items() if name in state}
    return fmt.load(parts, owner)


def read_extra_state(state: Any) -> dict[str, Any]:
    """A readable view of an ``fc.Linear``'s extra state (any version fastcast loads)::

        {"kind": "stateless"}
        {"kind": "delayed_scaling",
         "forward": {"amax_history": [L, 2], "scale": [2], "origin": {...}},
         "backward": {"amax_history": [L, 1], "scale": [1], "origin": {...}}}

    ``origin`` holds the recipe fields the scales were made under (None where unknown).
    The tensors are copies; a ValueError says what is wrong with a state fastcast
    would refuse to load.
    """
    module_state = decode_extra_state(state, owner="extra state")
    if not module_state:
        return {"kind": "stateless"}
    fmt = format_of_state(module_state)
    assert fmt is not None  # decoded by it
    return {"kind": fmt.name, **fmt.view(module_state)}


def legacy_pickled_state(state: Any) -> Any:
    """What ``fc.Linear.__getstate__`` kept, in a form ``decode_extra_state`` reads: a
    module pickled by version 1 kept its module state as ``{key: {tensor name: tensor}}``,
    which is version 1's dict without its header (version 1 knew one kind: the format
    that names its entries)."""
    if not isinstance(state, dict):
        return state
    if not state:
        return None
    fmt = next(f for f in formats() if f.version_1_names)
    names = fmt.version_1_names
    return {
        "format": _V1_FORMAT,
        "version": 1,
        "kind": fmt.name,
        **{names.get(key, repr(key)): part for key, part in state.items()},
    }


def is_extra_state_entry(key: str, value: Any) -> bool:
    """Whether ``key: value`` of a state dict is an ``fc.Linear``'s extra state."""
    if not (isinstance(key, str) and key.rsplit(".", 1)[-1] == EXTRA_STATE_KEY):
        return False
    if value is None or _is_v1(value):
        return True
    return (
        isinstance(value, torch.Tensor)
        and not value.is_meta  # no values to read the magic from (nor sparse, nested)
        and not value.is_nested
        and value.layout == torch.strided
        and value.dtype == torch.float32
        and value.dim() == 1
        and value.numel() >= 2
        and value[0].item() == MAGIC
    )


def strip_extra_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` without fastcast's ``_extra_state`` entries, for loading a converted
    model's checkpoint into a plain one with ``strict=True``. A new dict of the same
    kind (an ``OrderedDict`` keeps its ``_metadata``); other entries are the same objects.
    """
    kept = OrderedDict((k, v) for k, v in state_dict.items() if not is_extra_state_entry(k, v))
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        kept._metadata = metadata  # type: ignore[attr-defined]
    return kept if isinstance(state_dict, OrderedDict) else dict(kept)


def _decode_unpickled(obj: Any, owner: str) -> dict[Any, Any]:
    """The module state of what an opted-in unpickling produced."""
    if obj is None:  # older TransformerEngine saved None for a module without FP8 state
        return {}
    if isinstance(obj, torch.Tensor) and obj.dtype != torch.uint8:
        return _decode_tensor(obj, owner)
    if _is_v1(obj):
        return _decode_v1(obj, owner)
    for fmt in formats():
        module_state = fmt.from_foreign(obj, owner)
        if module_state is not None:
            return module_state
    if isinstance(obj, dict):
        raise ValueError(
            f"{owner}: the unpickled extra state is a dict that is neither fastcast's nor "
            f"TransformerEngine's: {describe_items(obj)}"
        )
    raise ValueError(
        f"{owner}: the unpickled extra state is a {type(obj).__module__}.{type(obj).__qualname__}"
        ", neither fastcast's state nor TransformerEngine's"
    )
