"""The ``_extra_state`` codec: plain tensors and primitives, never a pickle.

Stateless recipes store nothing (``None``). Delayed scaling stores, per direction, the
amax history and scales as tensors, so a checkpoint loads with
``torch.load(weights_only=True, mmap=True)``. Anything else offered to a module (a
foreign framework's pickled bytes, say) is refused with a description of what it would
have imported, found by reading the pickle's opcodes without executing them.
"""

from __future__ import annotations

import io
import pickletools
from typing import Any

import torch

from .delayed import BACKWARD, FORWARD, ScalingMeta

FORMAT = "fastcast.extra_state"
VERSION = 1
_DIRECTIONS = {"forward": FORWARD, "backward": BACKWARD}


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
    """Metas from ``encode_extra_state``'s output; a clear error for anything else."""
    if state is None:
        return {}
    if isinstance(state, dict) and state.get("format") == FORMAT:
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
                if not all(isinstance(part.get(k), torch.Tensor) for k in keys):
                    raise ValueError(f"{owner}: extra state '{name}' must hold tensors")
                metas[direction] = ScalingMeta.from_state(part)
        return metas
    if isinstance(state, (bytes, bytearray, io.BytesIO)) or (
        isinstance(state, torch.Tensor) and state.dtype == torch.uint8
    ):
        raise ValueError(
            f"{owner}: refusing a pickled extra state ({describe_pickle(state)}); fastcast "
            "never unpickles checkpoint state. It most likely comes from another FP8 "
            "library; load the weights with strict=False and let fastcast start its scales "
            "afresh (or calibrate)."
        )
    raise ValueError(f"{owner}: unrecognised extra state of type {type(state).__name__}")


def describe_pickle(payload: Any) -> str:
    """What a pickle would import, read from its opcodes without executing anything."""
    if isinstance(payload, io.BytesIO):
        data = payload.getvalue()
    elif isinstance(payload, torch.Tensor):
        data = bytes(payload.cpu().tolist())
    else:
        data = bytes(payload)
    imports: list[str] = []
    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("GLOBAL", "INST") and isinstance(arg, str):
                imports.append(arg.replace(" ", "."))
            elif opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE") and isinstance(
                arg, str
            ):
                strings.append(arg)
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                imports.append(f"{strings[-2]}.{strings[-1]}")
    except Exception as exc:  # noqa: BLE001 - a malformed pickle is still described
        return f"{len(data)} bytes, not a readable pickle: {exc}"
    if imports:
        return f"{len(data)} bytes importing {', '.join(sorted(set(imports)))}"
    return f"{len(data)} bytes of pickle, importing nothing"
