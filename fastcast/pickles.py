"""Reading pickles without trusting them: what one would import, and unpickling on request.

``describe_pickle`` walks the opcodes (of a plain pickle or of a ``torch.save`` archive's
``data.pkl``) without executing anything. ``unpickle`` runs one, and is only called
inside ``fc.allow_unsafe_extra_state()``.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import types
import zipfile
from typing import Any

import torch

ZIP_MAGIC = b"PK\x03\x04"  # how every torch.save archive starts
_MAX_DESCRIBED_PICKLE = 64 << 20  # bytes of an archive's data.pkl read when describing it


class _Absent:
    """Stands in for a TransformerEngine class when TransformerEngine is not installed.

    TransformerEngine pickles its recipe object next to the scales; the recipe is left
    behind anyway, so a checkpoint converts without TransformerEngine. Takes whatever
    arguments and state unpickling gives it.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> _Absent:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__}, not importable here>"


class _Unpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that substitutes ``_Absent`` for missing TransformerEngine classes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stand_ins: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except ImportError:
            if module.partition(".")[0] != "transformer_engine":
                raise
        cls = self._stand_ins.get((module, name))
        if cls is None:
            cls = self._stand_ins[module, name] = type(
                name, (_Absent,), {"__module__": module, "__qualname__": name}
            )
        return cls


# What torch.load takes as its pickle module: the one above, for archives' data.pkl.
_pickle_module = types.ModuleType(f"{__name__}._pickle")
_pickle_module.Unpickler = _Unpickler  # type: ignore[attr-defined]
_pickle_module.load = pickle.load  # type: ignore[attr-defined]


def unpickle(data: bytes, owner: str) -> Any:
    """Unpickle a payload: a torch.save archive (tensors mapped to the CPU) or a bare pickle."""
    try:
        if data.startswith(ZIP_MAGIC):
            return torch.load(
                io.BytesIO(data),
                map_location="cpu",
                weights_only=False,
                pickle_module=_pickle_module,
            )
        return _Unpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise ValueError(
            f"{owner}: could not unpickle the extra state ({describe_pickle(data)}): {exc}"
        ) from exc


# -- reading a pickle without running it ---------------------------------------------------
def payload_bytes(payload: Any) -> bytes:
    if isinstance(payload, io.BytesIO):
        return payload.getvalue()
    if isinstance(payload, torch.Tensor):
        return bytes(payload.detach().reshape(-1).cpu().tolist())
    return bytes(payload)


def describe_pickle(payload: Any) -> str:
    """What a pickle would import, read from its opcodes without executing anything.

    Takes bytes, a ``BytesIO`` or a uint8 tensor; a torch.save archive is opened as a zip
    and its ``data.pkl`` read the same way.
    """
    data = payload_bytes(payload)
    pickled, what = data, "pickle"
    if data.startswith(ZIP_MAGIC):
        what = "torch.save archive"
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                entry = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
                if entry.file_size > _MAX_DESCRIBED_PICKLE:
                    return f"{len(data)} bytes, a zip archive with a {entry.file_size}-byte pickle"
                pickled = archive.read(entry)
        except (StopIteration, zipfile.BadZipFile, OSError, ValueError) as exc:
            return f"{len(data)} bytes, a zip archive without a readable data.pkl ({exc!r})"
    try:
        imports = _pickle_imports(pickled)
    except Exception as exc:  # noqa: BLE001 - a malformed pickle is still described
        return f"{len(data)} bytes, not a readable pickle: {exc}"
    if imports:
        return f"{len(data)}-byte {what} importing {', '.join(sorted(set(imports)))}"
    return f"{len(data)}-byte {what}, importing nothing"


_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})


def _pickle_imports(data: bytes) -> list[str]:
    """The globals a pickle names, following its memo for ``STACK_GLOBAL``'s operands.

    Tracks only what the pickler emits for a global (two strings, each pushed or fetched
    from the memo, then ``STACK_GLOBAL``); operands built any other way are reported as
    computed at load time.
    """
    imports: list[str] = []
    memo: dict[Any, Any] = {}
    recent: list[Any] = [None, None]  # the last two values pushed: a str, or None
    for opcode, arg, _ in pickletools.genops(data):
        name = opcode.name
        if name in ("GLOBAL", "INST") and isinstance(arg, str):
            imports.append(arg.replace(" ", "."))
            pushed: Any = None
        elif name == "STACK_GLOBAL":
            module, attr = recent[-2], recent[-1]
            if isinstance(module, str) and isinstance(attr, str):
                imports.append(f"{module}.{attr}")
            else:
                imports.append("<a global computed at load time>")
            pushed = None
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1]
            continue
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = recent[-1]
            continue
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed = memo.get(arg)
        elif name in _STRING_OPS:
            pushed = arg
        elif opcode.stack_after:
            pushed = None
        else:
            continue
        recent = [recent[-1], pushed]
    return imports
