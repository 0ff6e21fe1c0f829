"""The inert objects a DCP ``.metadata`` pickle is unpickled into, and the allow-list that
names them (``METADATA_ALLOW_LIST``): what DCP's ``FileSystemWriter`` pickles, nothing
else. Nothing of torch's is constructed or changed while the pickle runs.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from ..pickle_model import AllowList
from ..transformer_engine import _ReadOnlyClass
from ..unpickled_torch import _Allowed, _ReadOnly, torch_dtypes

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
    allowed |= torch_dtypes()
    return AllowList(
        allowed,
        "what DCP's metadata holds (its dataclasses, torch.Size, dtypes, plain containers)",
        buildable=_STAND_INS,
        refusal="not in a DCP checkpoint's metadata, which fastcast reads without running it",
    )


# What fastcast unpickles of a DCP checkpoint's .metadata.
METADATA_ALLOW_LIST = _metadata_allow_list()


def _kind(value: Any) -> str:
    if isinstance(value, _StandIn):
        return f"stand-in for {type(value).__qualname__}"
    if type(value) is _Token:
        return value.kind
    return type(value).__name__
