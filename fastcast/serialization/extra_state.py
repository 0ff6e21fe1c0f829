"""The ``_extra_state`` codec: one float32 tensor per module; a pickle only when asked.

``fc.Linear.get_extra_state()`` always returns a 1-D float32 tensor, so a state dict
holds only tensors (safetensors, ``torch.load(weights_only=True, mmap=True)``, DCP and
Hugging Face ``save_pretrained`` all take it). Layout, version 2 (integers stored exactly
as float32; -1 marks a field that is unknown)::

    [0]  MAGIC (16557424 = 0xFCA570)     [8]  backward element format (0 e4m3, 1 e5m2)
    [1]  version (2)                     [9]  margin
    [2]  kind: 0 stateless, 1 delayed    [10] amax_compute_algo (0 max, 1 most_recent,
    [3]  header length H (16)                 2 a callable)
    [4]  amax history rows L             [11] scaling_factor_compute_algo set (0/1)
    [5]  forward columns (2 or 0)        [12] reduce_amax (0/1)
    [6]  backward columns (1 or 0)       [13..15] reserved, 0
    [7]  forward element format
    then the scales, forward columns (input, weight) first, then backward (grad_output);
    then the amax history [L, columns] row by row: row 0 is the step being recorded,
    rows 1..L-1 the previous steps, oldest first.

A stateless module stores the header alone (kind 0), so a state dict's layout does not
depend on whether the module has run under a stateless recipe. Version 1 (a dict of
strings, ints and tensors, or None) still loads.

Every state is validated before anything is loaded: a dense tensor with values (not on
the meta device, not sparse or nested); finite, positive scales; finite, non-negative
amaxes; consistent shapes; known fields. ``fc.Linear`` decodes its state before writing
its parameters, and every module that holds an ``fc.Linear`` (a model built from them,
or one ``fc.convert`` converted) has a load pre-hook that validates every ``fc.Linear``'s
state before the first parameter is written, so a refused load changes nothing
(``fastcast.nn.linear.validate_extra_states``).

A pickled payload offered to a module (``bytes``, ``bytearray``, ``io.BytesIO`` or a
uint8 tensor: the forms TransformerEngine stores its extra state in) is refused with a
description of what it would import, found by reading the pickle's opcodes without
executing them. Only inside ``fc.allow_unsafe_extra_state()`` is it unpickled, with a
restricted unpickler that builds only tensors, containers and TransformerEngine's recipe
classes (as inert stand-ins) and refuses any other global; what comes out is then loaded
if it is fastcast's own state or TransformerEngine's delayed-scaling state (see
``from_transformer_engine``), and is an error otherwise. An empty payload is
TransformerEngine's way of saying "no FP8 state": it loads as stateless in or out of the
block.
"""

from __future__ import annotations

import io
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from ..formats import FP8_FORMATS
from ..runtime.state import UnsafeExtraState, unsafe_extra_state_allowed
from ..schemes.delayed.state import (
    BACKWARD,
    FORWARD,
    UNKNOWN_ORIGIN,
    ScalingMeta,
    ScalingOrigin,
    check_scaling_tensors,
)
from .pickle_model import describe_pickle, payload_bytes
from .transformer_engine import (
    TE_ALLOW_LIST,
    TE_KEYS,
    describe_items,
    from_transformer_engine,
    hashable,
)
from .unpickling import unpickle

EXTRA_STATE_KEY = "_extra_state"  # nn.Module's name for it in state dicts
MAGIC = 0xFCA570
VERSION = 2
HEADER = 16
STATELESS, DELAYED = 0, 1
_STATELESS_HEADER = [float(MAGIC), float(VERSION), float(STATELESS), float(HEADER)] + [0.0] * (
    HEADER - 4
)
# Header slots.
_KIND, _HEADER_LEN, _ROWS, _FWD_COLS, _BWD_COLS, _FWD_FMT, _BWD_FMT = 2, 3, 4, 5, 6, 7, 8
_MARGIN, _ALGO, _CUSTOM, _REDUCE = 9, 10, 11, 12
_COLUMNS = {FORWARD: 2, BACKWARD: 1}  # what an fc.Linear keeps per direction
_FORMATS = FP8_FORMATS  # codes 0, 1 (the order is part of the file format)
_ALGOS = ("max", "most_recent", "callable")
UNKNOWN = -1
# Version 1: a dict, or None when stateless.
_V1_FORMAT = "fastcast.extra_state"
_V1_DIRECTIONS = {"forward": FORWARD, "backward": BACKWARD}


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


def encode_extra_state(metas: dict[int, ScalingMeta]) -> torch.Tensor:
    """The module's state as a new float32 CPU tensor (layout in the module docstring)."""
    if not metas:
        return torch.tensor(_STATELESS_HEADER)
    if not (metas.keys() <= {FORWARD, BACKWARD}) or not all(
        isinstance(m, ScalingMeta) for m in metas.values()
    ):
        # Another scheme kept per-module state this format cannot hold: never drop it.
        raise ValueError(
            "fc.Linear holds per-module state that fastcast's checkpoint format does not "
            f"know ({sorted(map(repr, metas))}); only DelayedScaling's state can be saved"
        )
    parts = [metas[d] for d in (FORWARD, BACKWARD) if d in metas]
    rows = parts[0].history.shape[0]
    if any(m.history.shape[0] != rows for m in parts):
        raise ValueError("delayed-scaling metas of one module must have one history length")
    origin = parts[0].origin
    header = list(_STATELESS_HEADER)
    fields = {
        _KIND: DELAYED,
        _ROWS: rows,
        _FWD_COLS: metas[FORWARD].n if FORWARD in metas else 0,
        _BWD_COLS: metas[BACKWARD].n if BACKWARD in metas else 0,
        _FWD_FMT: _code(metas[FORWARD].origin.fmt, _FORMATS) if FORWARD in metas else UNKNOWN,
        _BWD_FMT: _code(metas[BACKWARD].origin.fmt, _FORMATS) if BACKWARD in metas else UNKNOWN,
        _MARGIN: UNKNOWN if origin.margin is None else origin.margin,
        _ALGO: _code(origin.amax_compute_algo, _ALGOS),
        _CUSTOM: UNKNOWN if origin.custom_scale is None else int(origin.custom_scale),
        _REDUCE: UNKNOWN if origin.reduce_amax is None else int(origin.reduce_amax),
    }
    for slot, value in fields.items():
        header[slot] = float(value)
    scales = [m.scale.detach().float().cpu() for m in parts]
    history = torch.cat([m.history.detach().float().cpu() for m in parts], dim=1)
    return torch.cat([torch.tensor(header), *scales, history.reshape(-1)])


def _code(value: str | None, names: tuple[str, ...]) -> int:
    return UNKNOWN if value is None else names.index(value)


def decode_extra_state(state: Any, owner: str = "module") -> dict[int, ScalingMeta]:
    """Metas (on the CPU) from any state fastcast can load; a ValueError naming ``owner``
    and the problem for anything else. Never changes anything: callers install the result.

    A pickled payload is unpickled only inside ``allow_unsafe_extra_state``.
    """
    if state is None:  # version 1, stateless
        return {}
    if isinstance(state, torch.Tensor):
        _check_readable(state, owner, "extra state")
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


def _check_readable(t: torch.Tensor, owner: str, what: str) -> None:
    """ValueError naming ``owner`` unless ``t`` is a dense tensor with values to read (on
    any device but meta): a meta, sparse or nested tensor would otherwise fail deep in
    torch with a NotImplementedError or RuntimeError that names no module."""
    if t.is_meta:
        raise ValueError(
            f"{owner}: {what} is a tensor on the meta device, which holds no values (a "
            "state dict of a model not yet materialised?); load a state dict with data"
        )
    if t.is_nested or t.layout != torch.strided:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise ValueError(
            f"{owner}: {what} is a {layout} tensor; fastcast's state is a dense 1-D float32 "
            "tensor (load the state dict as the model saved it, or a dense copy)"
        )


def _decode_tensor(state: torch.Tensor, owner: str) -> dict[int, ScalingMeta]:
    """Version 2: the layout of the module docstring, checked field by field."""

    def refuse(problem: str) -> ValueError:
        return ValueError(f"{owner}: {problem}")

    _check_holds(state, owner, "extra state")
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
    if kind != DELAYED:
        raise refuse(f"unknown fastcast extra state kind {kind}")
    rows, fwd_cols, bwd_cols = head[_ROWS], head[_FWD_COLS], head[_BWD_COLS]
    if (
        rows < 1
        or fwd_cols not in (0, _COLUMNS[FORWARD])
        or bwd_cols not in (0, _COLUMNS[BACKWARD])
        or fwd_cols + bwd_cols == 0
    ):
        raise refuse(
            f"delayed-scaling state with {rows} history rows, {fwd_cols} forward and "
            f"{bwd_cols} backward columns; an fc.Linear keeps >= 1 rows and 2 forward, "
            "1 backward columns"
        )
    columns = fwd_cols + bwd_cols
    if flat.numel() != HEADER + columns + rows * columns:
        raise refuse(
            f"delayed-scaling state of {rows} rows x {columns} columns must hold "
            f"{HEADER + columns + rows * columns} values, got {flat.numel()}"
        )
    fields = {
        "forward format": (head[_FWD_FMT], len(_FORMATS)),
        "backward format": (head[_BWD_FMT], len(_FORMATS)),
        "amax_compute_algo": (head[_ALGO], len(_ALGOS)),
        "scaling_factor_compute_algo": (head[_CUSTOM], 2),
        "reduce_amax": (head[_REDUCE], 2),
    }
    for name, (value, count) in fields.items():
        if not UNKNOWN <= value < count:
            raise refuse(f"delayed-scaling state has an invalid {name} code {value}")
    if head[_MARGIN] < UNKNOWN:
        raise refuse(f"delayed-scaling state has an invalid margin {head[_MARGIN]}")
    scales = flat[HEADER : HEADER + columns]
    history = flat[HEADER + columns :].reshape(rows, columns)
    # All values in one read: finite and >= 0, scales > 0 (NaN fails every comparison).
    low, high = torch.aminmax(flat[HEADER:])
    low, high, scale_low = torch.stack([low, high, scales.min()]).tolist()
    checked = low >= 0 and high < math.inf and scale_low > 0

    def known(code: int, names: tuple[str, ...]) -> str | None:
        return None if code == UNKNOWN else names[code]

    def flag(code: int) -> bool | None:
        return None if code == UNKNOWN else bool(code)

    def origin(fmt_code: int) -> ScalingOrigin:
        return ScalingOrigin(
            known(fmt_code, _FORMATS),
            None if head[_MARGIN] == UNKNOWN else head[_MARGIN],
            known(head[_ALGO], _ALGOS),
            flag(head[_CUSTOM]),
            flag(head[_REDUCE]),
        )

    parts = {}
    offset = 0
    for direction, cols, fmt in (
        (FORWARD, fwd_cols, head[_FWD_FMT]),
        (BACKWARD, bwd_cols, head[_BWD_FMT]),
    ):
        if cols:
            parts[direction] = (
                history[:, offset : offset + cols],
                scales[offset : offset + cols],
                origin(fmt),
            )
            offset += cols
    return _metas(parts, owner, checked)


def _check_holds(tensor: Any, owner: str, what: str) -> None:
    """Refuse a tensor that claims more elements than its storage holds (a stride-0 view
    of a few bytes in a file can claim millions, which any copy would then allocate)."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        return
    held = tensor.untyped_storage().nbytes() // tensor.element_size() - tensor.storage_offset()
    if tensor.numel() > max(held, 0):
        raise ValueError(
            f"{owner}: {what} claims {tensor.numel()} values (shape {tuple(tensor.shape)}) but "
            f"its storage holds {max(held, 0)}; refusing it before copying"
        )


def _metas(
    parts: dict[int, tuple[torch.Tensor, torch.Tensor, ScalingOrigin]],
    owner: str,
    checked: bool = False,
) -> dict[int, ScalingMeta]:
    """Validated metas (on the CPU, holding copies) from per-direction ``(history, scale,
    origin)``; ``checked``: the values are known to be finite, amaxes >= 0, scales > 0."""
    metas = {}
    for direction, (history, scale, origin) in parts.items():
        name = "forward" if direction == FORWARD else "backward"
        _check_holds(history, owner, f"{name} amax history")
        _check_holds(scale, owner, f"{name} scale")
        if not checked:
            for t, what in ((history, "amax_history"), (scale, "scale")):
                if isinstance(t, torch.Tensor):
                    _check_readable(t, owner, f"{name} {what}")
            # The column count first: a state of zero columns has nothing for the value
            # checks to read (torch's min of an empty tensor is an error of its own).
            if isinstance(scale, torch.Tensor) and scale.dim() == 1:
                _check_columns(scale.shape[0], direction, owner)
            try:
                check_scaling_tensors(history, scale)
            except ValueError as exc:
                raise ValueError(f"{owner}: {name} {exc}") from None
        _check_columns(scale.shape[0], direction, owner)
        history = history.detach().to("cpu", torch.float32, copy=True)
        metas[direction] = ScalingMeta.holding(
            history, scale.detach().to("cpu", torch.float32, copy=True), origin
        )
    rows = {meta.history.shape[0] for meta in metas.values()}
    if len(rows) > 1:
        raise ValueError(f"{owner}: the directions' amax histories differ in length {sorted(rows)}")
    return metas


def _check_columns(columns: int, direction: int, owner: str) -> None:
    if columns != _COLUMNS[direction]:
        name = "forward" if direction == FORWARD else "backward"
        raise ValueError(
            f"{owner}: {name} delayed-scaling state has {columns} columns; an fc.Linear "
            f"keeps {_COLUMNS[direction]}"
        )


def _is_v1(state: Any) -> bool:
    return isinstance(state, dict) and state.get("format") == _V1_FORMAT


def _decode_v1(state: dict[str, Any], owner: str) -> dict[int, ScalingMeta]:
    """Version 1: ``{"format", "version": 1, "kind": "delayed_scaling", "forward":
    {"amax_history", "scale"}, "backward": {...}}``; no recipe fields (origin unknown)."""
    if state.get("version") != 1 or state.get("kind") != "delayed_scaling":
        raise ValueError(
            f"{owner}: unsupported fastcast extra state version={state.get('version')!r} "
            f"kind={state.get('kind')!r} (this fastcast reads versions 1 and {VERSION})"
        )
    unknown = set(state) - {"format", "version", "kind", *_V1_DIRECTIONS}
    if unknown:
        raise ValueError(f"{owner}: fastcast extra state with unknown keys {sorted(unknown)}")
    parts = {}
    for name, direction in _V1_DIRECTIONS.items():
        if name in state:
            part = state[name]
            if not isinstance(part, dict) or set(part) != {"amax_history", "scale"}:
                raise ValueError(
                    f"{owner}: extra state '{name}' must hold exactly the tensors "
                    "'amax_history' and 'scale'"
                )
            parts[direction] = (part["amax_history"], part["scale"], UNKNOWN_ORIGIN)
    return _metas(parts, owner)


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
    metas = decode_extra_state(state, owner="extra state")
    view: dict[str, Any] = {"kind": "delayed_scaling" if metas else "stateless"}
    for direction, name in ((FORWARD, "forward"), (BACKWARD, "backward")):
        if direction in metas:
            meta = metas[direction]
            view[name] = {
                "amax_history": meta.history,
                "scale": meta.scale,
                "origin": meta.origin._asdict(),
            }
    return view


def legacy_pickled_state(state: Any) -> Any:
    """What ``fc.Linear.__getstate__`` kept, in a form ``decode_extra_state`` reads: a
    module pickled by version 1 kept ``{direction: {"amax_history", "scale"}}``."""
    if not isinstance(state, dict):
        return state
    if not state:
        return None
    names = {FORWARD: "forward", BACKWARD: "backward"}
    return {
        "format": _V1_FORMAT,
        "version": 1,
        "kind": "delayed_scaling",
        **{names.get(d, repr(d)): part for d, part in state.items()},
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


def _decode_unpickled(obj: Any, owner: str) -> dict[int, ScalingMeta]:
    """Metas from what an opted-in unpickling produced."""
    if obj is None:  # older TransformerEngine saved None for a module without FP8 state
        return {}
    if isinstance(obj, torch.Tensor) and obj.dtype != torch.uint8:
        return _decode_tensor(obj, owner)
    if _is_v1(obj):
        return _decode_v1(obj, owner)
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
