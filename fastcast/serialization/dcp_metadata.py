"""Reading a DCP checkpoint's ``.metadata`` and byte entries without running them.

torch.distributed.checkpoint's ``FileSystemReader.read_metadata`` is ``pickle.load`` of the
checkpoint's ``.metadata`` file: whatever the file's pickle calls runs. ``read_metadata``
here reads the same file with fastcast's restricted unpickler (``unpickling.py``) and
``METADATA_ALLOW_LIST``, which names what DCP's ``FileSystemWriter`` pickles and nothing
else: DCP's metadata dataclasses (``Metadata``, ``TensorStorageMetadata``,
``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties`` with its
memory-format enum, ``MetadataIndex``, ``StorageMeta``, the file system's
``_StorageInfo``), ``torch.Size``, dtypes and layouts, a path (the ``checkpoint_id`` DCP
records), and plain containers, numbers and strings.

The unpickler hands the pickle only inert objects of fastcast's own: stand-ins for the
dataclasses (they keep what they are given: arguments and state, a state given once),
tokens for the enum member and paths, ``torch.Size`` of ints, and dtypes and layouts
(which cannot be changed). Nothing of torch's is constructed or changed while the pickle
runs. The stand-ins are then checked field by field (types, sizes within their tensor,
storage entries a plain file name of the checkpoint's folder) and only then turned into
DCP's own objects. Anything else is refused with a ``CheckpointMetadataError`` that
describes the file (``pickle_model.describe_pickle``: what it would import and call, read
from its opcodes). No describing pass runs first: its caps are sized for extra states,
while the metadata of a large sharded checkpoint holds millions of opcodes, and the
restricted unpickler cannot run anything whatever the file holds.

DCP saves every entry of a state dict that is not a tensor (a step count, an extra state
TransformerEngine keeps as bytes or ``io.BytesIO``) as a ``torch.save`` of the value,
which its default planner loads with ``torch.load(weights_only=False)``.
``load_entry`` loads it with the restricted unpickler after describing it (as extra
states are: ``unpickling.unpickle``), allowing ``ENTRY_ALLOW_LIST``: plain data and
tensors, and byte buffers (``bytes``, ``bytearray`` and ``io.BytesIO``, as Python's
protocol 2 pickles them).

This module imports ``torch.distributed.checkpoint``; only ``fastcast.dcp`` imports it.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from .pickle_model import AllowList, describe_pickle, escape
from .transformer_engine import _ReadOnlyClass
from .unpickled_torch import _Allowed, _ReadOnly
from .unpickling import TORCH_ALLOW_LIST, _RestrictedUnpickler, unpickle

__all__ = [
    "ENTRY_ALLOW_LIST",
    "METADATA_ALLOW_LIST",
    "CheckpointMetadataError",
    "load_entry",
    "read_metadata",
]


class CheckpointMetadataError(ValueError):
    """A DCP ``.metadata`` that fastcast refuses to read: not what DCP's writer pickles.
    Nothing of it was run."""


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
# The dataclasses DCP's metadata holds, each pickled as NEWOBJ (no arguments) then BUILD.
_CLASSES = {
    (_METADATA_MODULE, "Metadata"): dcp_metadata.Metadata,
    (_METADATA_MODULE, "TensorStorageMetadata"): dcp_metadata.TensorStorageMetadata,
    (_METADATA_MODULE, "BytesStorageMetadata"): dcp_metadata.BytesStorageMetadata,
    (_METADATA_MODULE, "ChunkStorageMetadata"): dcp_metadata.ChunkStorageMetadata,
    (_METADATA_MODULE, "TensorProperties"): dcp_metadata.TensorProperties,
    (_METADATA_MODULE, "MetadataIndex"): dcp_metadata.MetadataIndex,
    (_METADATA_MODULE, "StorageMeta"): dcp_metadata.StorageMeta,
    (_FILESYSTEM_MODULE, "_StorageInfo"): dcp_filesystem._StorageInfo,
}


class _StandIn(metaclass=_ReadOnlyClass):
    """Stands in for one of DCP's metadata dataclasses while the pickle runs: keeps the
    arguments it is made with and the one state it is given (``BUILD``), and has no
    ``__dict__`` for a pickle to give attributes to."""

    __slots__ = ("args", "state", "built")

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        if kwargs:
            raise pickle.UnpicklingError(f"{cls.__qualname__} made with keyword arguments")
        self = object.__new__(cls)
        self.args, self.state, self.built = args, None, False
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # __new__ kept the arguments

    def __setstate__(self, state: Any) -> None:
        if self.built:
            raise pickle.UnpicklingError(f"{type(self).__qualname__} given a state twice")
        self.state, self.built = state, True

    def __repr__(self) -> str:
        return f"<stand-in for {type(self).__module__}.{type(self).__qualname__}>"


_STAND_INS: dict[tuple[str, str], type] = {
    key: _ReadOnlyClass(
        key[1], (_StandIn,), {"__module__": key[0], "__qualname__": key[1], "__slots__": ()}
    )
    for key in _CLASSES
}
_REAL = {stand_in: _CLASSES[key] for key, stand_in in _STAND_INS.items()}


class _Token(_ReadOnly):
    """What a call the pickle makes returns where the real value could be changed by a
    later ``BUILD`` (an enum member has a ``__dict__``; a path has slots): a kind and
    plain values, turned into the real value after the pickle has run."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "value", value)


def _size(dims: Any) -> torch.Size:
    if type(dims) not in (tuple, list) or not all(type(d) is int and d >= 0 for d in dims):
        raise pickle.UnpicklingError("torch.Size of anything but non-negative ints")
    return torch.Size(dims)


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: Any) -> torch.layout:
    layout = _LAYOUTS.get(name) if type(name) is str else None
    if layout is None:
        raise pickle.UnpicklingError("torch.serialization._get_layout of no torch layout")
    return layout


_MEMORY_FORMATS = {
    0: torch.contiguous_format,  # DCP's _MEM_FORMAT_ENCODING, by value
    1: torch.channels_last,
    2: torch.preserve_format,
}


def _memory_format(code: Any) -> _Token:
    if type(code) is not int or code not in _MEMORY_FORMATS:
        raise pickle.UnpicklingError("_MEM_FORMAT_ENCODING of an unknown value")
    return _Token("memory format", code)


def _path(kind: str) -> _Allowed:
    def make(*parts: Any) -> _Token:
        if not all(type(p) is str for p in parts):
            raise pickle.UnpicklingError(f"pathlib.{kind} of anything but strings")
        return _Token(kind, parts)

    return _Allowed(make, f"pathlib.{kind}")


def _metadata_allow_list() -> AllowList:
    allowed: dict[tuple[str, str], Any] = dict(_STAND_INS)
    allowed["torch", "Size"] = _Allowed(_size, "torch.Size")
    allowed["torch.serialization", "_get_layout"] = _Allowed(_layout, "_get_layout")
    allowed[_METADATA_MODULE, "_MEM_FORMAT_ENCODING"] = _Allowed(
        _memory_format, "_MEM_FORMAT_ENCODING"
    )
    for kind in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed["pathlib", kind] = _path(kind)
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed["torch", name] = value
    return AllowList(
        allowed,
        "what DCP's metadata holds (its dataclasses, torch.Size, dtypes, plain containers)",
        buildable=_STAND_INS,
        refusal="not in a DCP checkpoint's metadata, which fastcast reads without running it",
    )


# What fastcast unpickles of a DCP checkpoint's .metadata.
METADATA_ALLOW_LIST = _metadata_allow_list()


# -- from stand-ins to DCP's objects -------------------------------------------------------------
class _Bad(Exception):
    """The unpickled metadata is not what DCP writes (the message says where)."""


_PLAIN = (str, int, float, bool, bytes, type(None))
_MAX_DEPTH = 64  # of plain data (planner data): DCP's own nests a few levels


class _Converter:
    """Turns the unpickled stand-ins into DCP's objects, checking each as it goes. Objects
    the pickle shares (memo references) are converted once."""

    def __init__(self) -> None:
        self._done: dict[int, Any] = {}
        self._keep: list[Any] = []  # the stand-ins converted, so that their ids stay theirs

    def metadata(self, obj: Any) -> dcp_metadata.Metadata:
        state = self._fields(obj, dcp_metadata.Metadata, "the metadata")
        if "state_dict_metadata" not in state:
            raise _Bad("the metadata has no state_dict_metadata")
        entries = self._dict(state["state_dict_metadata"], "state_dict_metadata")
        state["state_dict_metadata"] = {
            self._str(k, "a state_dict_metadata key"): self._storage(v, f"entry {k!r}")
            for k, v in entries.items()
        }
        if state.get("storage_data") is not None:
            storage = self._dict(state["storage_data"], "storage_data")
            state["storage_data"] = {
                self._index(k): self._storage_info(v, f"the storage of {k!r}")
                for k, v in storage.items()
            }
        if state.get("storage_meta") is not None:
            state["storage_meta"] = self._storage_meta(state["storage_meta"])
        if state.get("version") is not None:
            self._str(state["version"], "the version")
        for name in state.keys() - {"state_dict_metadata", "storage_data", "storage_meta"}:
            state[name] = self._plain(state[name], name, 0)  # planner_data, version, newer
        return dcp_metadata.Metadata(**state)

    # -- the dataclasses ------------------------------------------------------------------------
    def _state(self, obj: Any, real: type, what: str) -> Any:
        """The state the pickle gave a stand-in of ``real`` (made without arguments)."""
        if _REAL.get(type(obj)) is not real:
            raise _Bad(f"{what} is a {_kind(obj)}, not DCP's {real.__name__}")
        if obj.args:
            raise _Bad(f"{what} ({real.__name__}) is made with arguments")
        self._keep.append(obj)
        return obj.state

    def _fields(self, obj: Any, real: type, what: str) -> dict[str, Any]:
        """The state of a dataclass stand-in, as keyword arguments of ``real``: a dict of
        its fields (a copy), those without defaults present."""
        state = self._state(obj, real, what)
        if state is None:
            state = {}
        if type(state) is not dict:
            raise _Bad(f"{what} ({real.__name__}) has a state of type {_kind(state)}")
        fields = {f.name: f for f in dataclasses.fields(real)}
        unknown = [k for k in state if k not in fields]
        if unknown:
            raise _Bad(f"{what} ({real.__name__}) has fields {real.__name__} lacks: {unknown!r}")
        missing = [
            name
            for name, f in fields.items()
            if name not in state
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise _Bad(f"{what} ({real.__name__}) lacks {missing!r}")
        return dict(state)

    def _once(self, obj: Any, make: Any) -> Any:
        done = self._done.get(id(obj))
        if done is None:
            done = self._done[id(obj)] = make()
        return done

    def _storage(self, obj: Any, what: str) -> Any:
        if _REAL.get(type(obj)) is dcp_metadata.BytesStorageMetadata:
            return self._once(obj, lambda: self._bytes_storage(obj, what))
        return self._once(obj, lambda: self._tensor_storage(obj, what))

    def _bytes_storage(self, obj: Any, what: str) -> Any:
        self._fields(obj, dcp_metadata.BytesStorageMetadata, what)
        return dcp_metadata.BytesStorageMetadata()

    def _tensor_storage(self, obj: Any, what: str) -> Any:
        state = self._fields(obj, dcp_metadata.TensorStorageMetadata, what)
        size = self._torch_size(state["size"], f"{what}'s size")
        chunks = state["chunks"]
        if type(chunks) is not list:
            raise _Bad(f"{what}'s chunks are a {_kind(chunks)}, not a list")
        return dcp_metadata.TensorStorageMetadata(
            properties=self._once(
                state["properties"], lambda: self._properties(state["properties"], what)
            ),
            size=size,
            chunks=[self._chunk(c, size, f"a chunk of {what}") for c in chunks],
        )

    def _properties(self, obj: Any, what: str) -> dcp_metadata.TensorProperties:
        state = self._state(obj, dcp_metadata.TensorProperties, f"{what}'s properties")
        if type(state) is not tuple or len(state) != 5:
            raise _Bad(f"{what}'s properties are not the 5 values DCP pickles")
        dtype, layout, requires_grad, memory_format, pin_memory = state
        if not (
            isinstance(dtype, torch.dtype)
            and isinstance(layout, torch.layout)
            and type(requires_grad) is bool
            and type(memory_format) is _Token
            and memory_format.kind == "memory format"
            and type(pin_memory) is bool
        ):
            raise _Bad(f"{what}'s properties are not a dtype, layout, memory format and flags")
        return dcp_metadata.TensorProperties(
            dtype=dtype,
            layout=layout,
            requires_grad=requires_grad,
            memory_format=_MEMORY_FORMATS[memory_format.value],
            pin_memory=pin_memory,
        )

    def _chunk(self, obj: Any, size: torch.Size, what: str) -> dcp_metadata.ChunkStorageMetadata:
        state = self._fields(obj, dcp_metadata.ChunkStorageMetadata, what)
        offsets = self._torch_size(state["offsets"], f"{what}'s offsets")
        sizes = self._torch_size(state["sizes"], f"{what}'s sizes")
        if not (
            len(offsets) == len(sizes) == len(size)
            and all(o + n <= whole for o, n, whole in zip(offsets, sizes, size))
        ):
            raise _Bad(
                f"{what} (offsets {tuple(offsets)}, sizes {tuple(sizes)}) is not inside the "
                f"tensor's size {tuple(size)}"
            )
        return dcp_metadata.ChunkStorageMetadata(offsets=offsets, sizes=sizes)

    def _index(self, obj: Any) -> dcp_metadata.MetadataIndex:
        state = self._fields(obj, dcp_metadata.MetadataIndex, "a storage_data key")
        fqn = self._str(state["fqn"], "a storage_data key's fqn")
        offset = state.get("offset")
        index = state.get("index")
        if offset is not None:
            offset = self._torch_size(offset, f"the offset of {fqn!r}")
        if not (index is None or (type(index) is int and index >= 0)):
            raise _Bad(f"the storage_data key of {fqn!r} has an index {_kind(index)}")
        return dcp_metadata.MetadataIndex(fqn, offset, index)

    def _storage_info(self, obj: Any, what: str) -> Any:
        state = self._fields(obj, dcp_filesystem._StorageInfo, what)
        path = self._str(state["relative_path"], f"{what}'s file")
        # A file of the checkpoint's own folder, as DCP's writer names them: not a path
        # that leads elsewhere (an absolute path, "..", a subfolder).
        if not path or path in (".", "..") or "/" in path or "\\" in path or "\0" in path:
            raise _Bad(f"{what} is in {escape(repr(path))}, not a file of the checkpoint's folder")
        for name in ("offset", "length"):
            if type(state[name]) is not int or state[name] < 0:
                raise _Bad(f"{what} has a {name} that is not an int >= 0")
        descriptors = state.get("transform_descriptors")
        if descriptors is not None and (
            type(descriptors) not in (list, tuple) or not all(type(d) is str for d in descriptors)
        ):
            raise _Bad(f"{what} has transform descriptors that are not strings")
        return dcp_filesystem._StorageInfo(**state)

    def _storage_meta(self, obj: Any) -> dcp_metadata.StorageMeta:
        state = self._fields(obj, dcp_metadata.StorageMeta, "the storage meta")
        checkpoint_id = state.get("checkpoint_id")
        if type(checkpoint_id) is _Token:
            make = (
                pathlib.PureWindowsPath
                if "Windows" in checkpoint_id.kind
                else pathlib.PurePosixPath
            )
            state["checkpoint_id"] = make(*checkpoint_id.value)
        elif checkpoint_id is not None:
            self._str(checkpoint_id, "the storage meta's checkpoint_id")
        for name in ("save_id", "load_id"):
            if state.get(name) is not None:
                self._str(state[name], f"the storage meta's {name}")
        modules = state.get("modules", [])
        if type(modules) is not list or not all(type(m) is str for m in modules):
            raise _Bad("the storage meta's modules are not a list of strings")
        state["modules"] = list(modules)
        return dcp_metadata.StorageMeta(**state)

    # -- values ---------------------------------------------------------------------------------
    @staticmethod
    def _str(value: Any, what: str) -> str:
        if type(value) is not str:
            raise _Bad(f"{what} is a {_kind(value)}, not a string")
        return value

    @staticmethod
    def _dict(value: Any, what: str) -> dict[Any, Any]:
        if type(value) is not dict:
            raise _Bad(f"{what} is a {_kind(value)}, not a dict")
        return value

    @staticmethod
    def _torch_size(value: Any, what: str) -> torch.Size:
        if type(value) is not torch.Size:
            raise _Bad(f"{what} is a {_kind(value)}, not a torch.Size")
        return value

    def _plain(self, value: Any, what: str, depth: int) -> Any:
        """Plain data (containers, numbers, strings, dtypes, sizes), as it is."""
        if type(value) in _PLAIN or isinstance(value, (torch.dtype, torch.Size)):
            return value
        if depth >= _MAX_DEPTH:
            raise _Bad(f"{what} nests over {_MAX_DEPTH} levels")
        if id(value) in self._done:
            return value
        if type(value) in (list, tuple, set, frozenset):
            self._done[id(value)] = value
            for item in value:
                self._plain(item, what, depth + 1)
            return value
        if type(value) is dict:
            self._done[id(value)] = value
            for key, item in value.items():
                self._plain(key, what, depth + 1)
                self._plain(item, what, depth + 1)
            return value
        raise _Bad(f"{what} holds a {_kind(value)}")


def _kind(value: Any) -> str:
    if isinstance(value, _StandIn):
        return f"stand-in for {type(value).__qualname__}"
    if type(value) is _Token:
        return value.kind
    return type(value).__name__


def read_metadata(data: bytes, where: str) -> dcp_metadata.Metadata:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file (``where`` names it in
    errors), read without running anything; a ``CheckpointMetadataError`` describing the
    file for anything DCP's writer would not have written."""
    try:
        unpickled = _RestrictedUnpickler(io.BytesIO(data), METADATA_ALLOW_LIST).load()
        return _Converter().metadata(unpickled)
    except Exception as exc:  # noqa: BLE001 - every failure is a refusal, described
        problem = escape(str(exc)) or type(exc).__name__
    report = describe_pickle(data, METADATA_ALLOW_LIST)
    raise CheckpointMetadataError(
        f"{where}: refusing the checkpoint's metadata ({report}): {problem}. fastcast reads "
        "a DCP .metadata only as DCP's writer makes it and ran nothing of this one: it was "
        "not written by DCP, or was changed since"
    )


# -- entries saved as bytes ---------------------------------------------------------------------
_BYTES_LIKE = (bytes, bytearray)


def _buffer(args: tuple[Any, ...], what: str) -> bytes:
    """The bytes ``bytes(*args)`` / ``bytearray(*args)`` would hold, for what pickle
    protocols 0 to 2 write: nothing, bytes, or text with its latin-1 encoding (never a
    length: ``bytes(10**12)`` would allocate a terabyte)."""
    if not args:
        return b""
    if len(args) == 1 and type(args[0]) in _BYTES_LIKE:
        return bytes(args[0])
    if len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
        return args[0].encode("latin-1")
    raise pickle.UnpicklingError(f"{what} of anything but bytes or latin-1 text")


def _bytes(*args: Any) -> bytes:
    return _buffer(args, "bytes")


def _bytearray(*args: Any) -> bytearray:
    return bytearray(_buffer(args, "bytearray"))


class _PlainBytesIO(io.BytesIO):
    """``io.BytesIO`` as unpickled: its bytes and position only (``BUILD`` would otherwise
    give the instance attributes, its own ``getvalue`` say, that shadow its methods)."""

    def __setstate__(self, state: Any) -> None:
        if not (
            type(state) is tuple
            and len(state) == 3
            and type(state[0]) in _BYTES_LIKE
            and type(state[1]) is int
            and 0 <= state[1] <= len(state[0])
            and not state[2]
        ):
            raise pickle.UnpicklingError(
                "an io.BytesIO given a state other than bytes and a position"
            )
        io.BytesIO.__setstate__(self, (bytes(state[0]), state[1], None))

    def __reduce__(self) -> Any:  # copies and pickles as the plain BytesIO it stands for
        return io.BytesIO, (self.getvalue(),)


# What fastcast unpickles of a DCP entry saved as bytes.
ENTRY_ALLOW_LIST = TORCH_ALLOW_LIST.extended(
    {
        ("builtins", "bytes"): _Allowed(_bytes, "bytes"),
        ("builtins", "bytearray"): _Allowed(_bytearray, "bytearray"),
        ("_io", "BytesIO"): _PlainBytesIO,
    },
    "plain containers, tensors and byte buffers",
    buildable=[("_io", "BytesIO")],
)


def load_entry(data: bytes, owner: str) -> Any:
    """The value DCP saved as bytes (a ``torch.save`` of it), described and then loaded
    with the restricted unpickler allowing ``ENTRY_ALLOW_LIST``; a ``ValueError`` naming
    ``owner`` and describing what else it would import."""
    return unpickle(data, owner, ENTRY_ALLOW_LIST, what="the entry")
