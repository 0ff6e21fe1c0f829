"""From the unpickled stand-ins to DCP's own metadata objects, each field checked (types,
chunks inside their tensor, storage files inside the checkpoint's folder) before any DCP
object is made.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from ..pickle_model import escape
from .stand_ins import _MEMORY_FORMATS, _REAL, _kind, _Token


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
