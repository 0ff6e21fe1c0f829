"""Unpickling only what an allow-list names, described first.

``unpickle`` loads a payload with a ``pickle.Unpickler`` whose ``find_class`` gives only
what an ``AllowList`` names, after ``pickle_model.inspect_pickle`` described the payload
without surprises: here the unpicklers (a bare pickle, a ``torch.save`` archive, a legacy
``torch.save`` stream) and ``TORCH_ALLOW_LIST``. Tensors and storages are rebuilt by
``unpickled_torch.py``, never by torch's own loader: every size the payload claims is
checked against the bytes it holds before anything is allocated, and loaded tensors are
plain data (no autograd, no state set on them). Nothing here knows any library's format;
``transformer_engine.py`` extends ``TORCH_ALLOW_LIST`` with TransformerEngine's recipe
classes.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import zipfile
from typing import Any

import torch

from .pickle_model import AllowList, escape, inspect_pickle
from .pickle_symbols import ZIP_MAGIC, _clip
from .unpickled_torch import (
    _TENSOR_REBUILDS,
    STORAGE_ALLOW_LIST,
    _Allowed,
    _is_int,
    _latin1,
    _PlainOrderedDict,
    _rebuild_tensor,
    _refuse_tensor_state,
    _Storage,
    _storage_types,
    _StorageType,
    torch_dtypes,
)


def _load_nested_storage(data: Any) -> _Storage:
    """``torch.storage._load_from_bytes``, restricted (the original runs
    ``torch.load(weights_only=False)`` on whatever bytes it is given): the bytes must be a
    ``torch.save`` of one storage, read here with ``STORAGE_ALLOW_LIST``."""
    if not isinstance(data, (bytes, bytearray)):
        raise pickle.UnpicklingError("torch.storage._load_from_bytes is given no bytes")
    data = bytes(data)
    if data.startswith(ZIP_MAGIC):
        loaded = _load_archive(data, STORAGE_ALLOW_LIST)
    else:
        loaded = _load_stream(data, STORAGE_ALLOW_LIST)
    if not isinstance(loaded, _Storage):
        raise pickle.UnpicklingError(
            f"torch.storage._load_from_bytes gives a {type(loaded).__name__}, not a storage"
        )
    return loaded


def _torch_allow_list() -> AllowList:
    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): _PlainOrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("_codecs", "encode"): _Allowed(_latin1, "_codecs.encode"),
        ("torch._utils", "_rebuild_tensor"): _Allowed(_rebuild_tensor, "_rebuild_tensor"),
        ("torch._utils", "_rebuild_tensor_v2"): _Allowed(_rebuild_tensor, "_rebuild_tensor_v2"),
        ("torch.storage", "_load_from_bytes"): _Allowed(_load_nested_storage, "_load_from_bytes"),
        **_storage_types(),
    }
    allowed |= torch_dtypes()
    return AllowList(
        allowed,
        "plain containers and tensors",
        containers=[("collections", "OrderedDict")],
    )


# Plain data and tensors: containers, numbers and strings, tensors and their storages.
TORCH_ALLOW_LIST = _torch_allow_list()


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles what ``allowed`` names; refuses any other global by name, before
    importing it. Tensors it makes refuse a state (``BUILD``) while it runs."""

    def __init__(self, file: Any, allowed: AllowList) -> None:
        super().__init__(file)
        self._allow = allowed
        self._tensors: list[torch.Tensor] = []

    def find_class(self, module: str, name: str) -> Any:
        found = self._allow.get(module, name)
        if found is None:
            raise pickle.UnpicklingError(
                escape(
                    f"{_clip(f'{module}.{name}')} is not allowed: fastcast unpickles only "
                    f"{self._allow.what}"
                )
            )
        if (module, name) in _TENSOR_REBUILDS:
            return _Allowed(self._rebuild_tensor, name)
        return found

    def _rebuild_tensor(self, *args: Any) -> torch.Tensor:
        tensor = _rebuild_tensor(*args)
        # BUILD looks __setstate__ up on the object, where an instance attribute wins
        # over Tensor.__setstate__ (which would call set_ with sizes of the pickle's own).
        tensor.__setstate__ = _refuse_tensor_state  # type: ignore[method-assign]
        self._tensors.append(tensor)
        return tensor

    def load(self) -> Any:
        try:
            return super().load()
        finally:
            for tensor in self._tensors:
                del tensor.__setstate__
            self._tensors.clear()

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id outside a torch.save archive or stream")


def _storage_id(pid: Any, length: int) -> tuple[_StorageType, str, int]:
    """(storage type, key, elements) of a torch.save storage's persistent id."""
    if not (
        type(pid) is tuple
        and len(pid) == length
        and pid[0] == "storage"
        and isinstance(pid[1], _StorageType)
        and type(pid[2]) is str
        and _is_int(pid[4])
        and pid[4] >= 0
    ):
        raise pickle.UnpicklingError("a persistent id other than a torch.save storage")
    return pid[1], pid[2], pid[4]


class _ArchiveUnpickler(_RestrictedUnpickler):
    """Unpickles a torch.save archive's ``data.pkl``, reading its storages from the archive."""

    def __init__(
        self, file: Any, allowed: AllowList, archive: zipfile.ZipFile, prefix: str
    ) -> None:
        super().__init__(file, allowed)
        self._archive = archive
        self._prefix = prefix
        self._storages: dict[str, _Storage] = {}

    def persistent_load(self, pid: Any) -> Any:
        storage_type, key, numel = _storage_id(pid, 5)
        storage = self._storages.get(key)
        if storage is None:
            name = f"{self._prefix}/data/{key}"
            try:
                info = self._archive.getinfo(name)
            except KeyError:
                raise pickle.UnpicklingError(f"the archive has no {_clip(name)!r}") from None
            size = numel * storage_type.dtype.itemsize
            # torch.save stores storages uncompressed: a compressed entry could claim a
            # gigabyte from a few kilobytes, so only what the archive holds is read.
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise pickle.UnpicklingError(f"{_clip(name)!r} is compressed")
            if info.file_size != size:
                raise pickle.UnpicklingError(
                    f"{_clip(name)!r} holds {info.file_size} bytes, not {size}"
                )
            if size:
                raw = self._archive.read(info)
                untyped = torch.UntypedStorage.from_buffer(raw, dtype=torch.uint8)
            else:
                untyped = torch.UntypedStorage(0)
            storage = self._storages[key] = _Storage(untyped, storage_type.dtype)
        elif storage.dtype != storage_type.dtype:
            raise pickle.UnpicklingError(f"storage {_clip(key)!r} read with two dtypes")
        return storage


def _load_archive(data: bytes, allowed: AllowList) -> Any:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        first = archive.infolist()[0].filename if archive.infolist() else ""
        prefix = first.partition("/")[0]
        if not prefix or "/" not in first:
            raise pickle.UnpicklingError("not a torch.save archive (no top-level folder)")
        names = set(archive.namelist())
        if f"{prefix}/byteorder" in names:
            order = archive.read(f"{prefix}/byteorder").decode("ascii", "replace")
            if order != sys.byteorder:
                raise pickle.UnpicklingError(escape(f"an archive written {order}-endian"))
        pickled = archive.read(f"{prefix}/data.pkl")
        return _ArchiveUnpickler(io.BytesIO(pickled), allowed, archive, prefix).load()


# A legacy torch.save stream: pickles of this magic number, this protocol version, the
# system's information, the object, and the storage keys; then per key the storage's
# element count (8 bytes, little-endian) and its bytes.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


class _StreamUnpickler(_RestrictedUnpickler):
    """Unpickles a legacy stream's object: its storages are claimed here (each checked
    against the bytes left in the stream before it is allocated) and filled afterwards."""

    def __init__(self, file: io.BytesIO, allowed: AllowList, size: int) -> None:
        super().__init__(file, allowed)
        self._file = file
        self._size = size
        self.storages: dict[str, _Storage] = {}
        self._claimed = 0

    def persistent_load(self, pid: Any) -> Any:
        storage_type, key, numel = _storage_id(pid, 6)
        dtype = storage_type.dtype
        storage = self.storages.get(key)
        if storage is None:
            nbytes = numel * dtype.itemsize
            self._claimed += 8 + nbytes
            if self._claimed > self._size - self._file.tell():
                raise pickle.UnpicklingError(
                    f"storages claiming {self._claimed} bytes in a stream with "
                    f"{self._size - self._file.tell()} bytes left"
                )
            untyped = torch.zeros(nbytes, dtype=torch.uint8).untyped_storage()
            storage = self.storages[key] = _Storage(untyped, dtype)
        elif storage.dtype != dtype:
            raise pickle.UnpicklingError(f"storage {_clip(key)!r} read with two dtypes")
        view = pid[5]
        if view is None:
            return storage
        if not (
            type(view) is tuple
            and len(view) == 3
            and all(_is_int(v) and v >= 0 for v in view[1:])
            and (view[1] + view[2]) * dtype.itemsize <= storage.untyped.nbytes()
        ):
            raise pickle.UnpicklingError("a storage view outside its storage")
        start, stop = view[1] * dtype.itemsize, (view[1] + view[2]) * dtype.itemsize
        return _Storage(storage.untyped[start:stop], dtype)


def _load_stream(data: bytes, allowed: AllowList) -> Any:
    """A bare pickle, or a legacy ``torch.save`` stream (when the first pickle is its
    magic number and more follows), read as ``torch.load`` reads one."""
    file = io.BytesIO(data)
    first = _RestrictedUnpickler(file, allowed).load()
    if not (_is_int(first) and first == _LEGACY_MAGIC and file.tell() < len(data)):
        return first
    if _RestrictedUnpickler(file, allowed).load() != _LEGACY_PROTOCOL:
        raise pickle.UnpicklingError("a legacy torch.save stream of another protocol version")
    _RestrictedUnpickler(file, allowed).load()  # the system's information, unused by torch too
    unpickler = _StreamUnpickler(file, allowed, len(data))
    result = unpickler.load()
    keys = _RestrictedUnpickler(file, allowed).load()
    if not (type(keys) is list and all(type(k) is str for k in keys)):
        raise pickle.UnpicklingError("a legacy torch.save stream whose storage keys are not a list")
    for key in keys:
        storage = unpickler.storages.get(key)
        if storage is None:
            raise pickle.UnpicklingError(
                f"a legacy torch.save stream without storage {_clip(key)!r}"
            )
        header = file.read(8)
        expected = storage.untyped.nbytes()
        if len(header) < 8 or struct.unpack("<q", header)[0] * storage.dtype.itemsize != expected:
            raise pickle.UnpicklingError(f"storage {_clip(key)!r} has the wrong size")
        raw = file.read(expected)
        if len(raw) < expected:
            raise pickle.UnpicklingError(f"storage {_clip(key)!r} is truncated")
        if expected:
            target = torch.empty(0, dtype=torch.uint8).set_(storage.untyped)
            target.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return result


def unpickle(data: bytes, owner: str, allowed: AllowList, what: str = "the extra state") -> Any:
    """Load a payload (a torch.save archive or stream, tensors on the CPU, or a bare
    pickle) with a restricted unpickler allowing ``allowed``, after describing it:
    anything it would import that is not allowed, anything unknown, or a payload too
    large to describe is refused before a byte of it is unpickled. Errors name ``owner``
    and ``what`` the payload is."""
    report = inspect_pickle(data, allowed)
    if not report.loadable:
        raise ValueError(f"{owner}: refusing to unpickle {what} ({report})")
    try:
        if data.startswith(ZIP_MAGIC):
            return _load_archive(data, allowed)
        return _load_stream(data, allowed)
    except Exception as exc:
        raise ValueError(
            f"{owner}: could not unpickle {what} ({report}): {escape(str(exc))}"
        ) from exc
