"""Unpickling only what an allow-list names, described first.

``unpickle`` loads a payload with a ``pickle.Unpickler`` whose ``find_class`` gives only
what an ``AllowList`` names, after ``pickles.inspect_pickle`` described the payload
without surprises. Tensors and storages are rebuilt here (``TORCH_ALLOW_LIST``), never
by torch's own loader: every size the payload claims is checked against the bytes it
holds before anything is allocated, and loaded tensors are plain data (no autograd, no
state set on them). Nothing here knows any library's format;
``schemes/delayed/te_state.py`` extends
``TORCH_ALLOW_LIST`` with TransformerEngine's recipe classes.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import sys
import zipfile
from typing import Any

import torch

from .pickle_model import ZIP_MAGIC, AllowList, _clip, escape, inspect_pickle


class _ReadOnly:
    """Instances cannot be changed after construction (by unpickling's BUILD, say)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} objects cannot be changed")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} objects cannot be changed")


class _Allowed(_ReadOnly):
    """A function the restricted unpickler gives for an allowed global."""

    __slots__ = ("_func", "_name")

    def __init__(self, func: Any, name: str) -> None:
        object.__setattr__(self, "_func", func)
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: Any) -> Any:
        return self._func(*args)

    def __repr__(self) -> str:
        return f"<fastcast's restricted {self._name}>"


class _StorageType(_ReadOnly):
    """A ``torch.*Storage`` class named in a persistent id: only its dtype is used."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", dtype)


class _Storage(_ReadOnly):
    """Bytes read for a tensor, and their element type."""

    __slots__ = ("untyped", "dtype")

    def __init__(self, untyped: torch.UntypedStorage, dtype: torch.dtype) -> None:
        object.__setattr__(self, "untyped", untyped)
        object.__setattr__(self, "dtype", dtype)


class _PlainOrderedDict(collections.OrderedDict):  # type: ignore[type-arg]
    """``collections.OrderedDict`` as unpickled: items only. Given a state by ``BUILD``
    it would keep instance attributes (its own ``get``, say) that shadow dict methods."""

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("an OrderedDict given a state (BUILD)")

    def __reduce__(self) -> Any:  # copies and pickles as the plain OrderedDict it stands for
        return collections.OrderedDict, (list(self.items()),)


def _is_int(value: Any) -> bool:
    return type(value) is int


def _refuse_tensor_state(*args: Any) -> None:
    raise pickle.UnpicklingError("a tensor given a state (BUILD would call Tensor.__setstate__)")


def _rebuild_tensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> torch.Tensor:
    """``torch._utils._rebuild_tensor(_v2)``, checking what it is given: a view that fits
    inside its storage and claims no more elements than the storage holds (``set_``
    would otherwise grow the storage, and a stride-0 view of one element could claim
    millions that every later copy allocates), no hooks, no metadata. The tensor is plain
    data: ``requires_grad`` is checked but not applied (loaded state takes no part in
    autograd)."""
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor whose data is not a storage")
    if not (
        _is_int(storage_offset)
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and len(size) == len(stride)
        and all(_is_int(n) and n >= 0 for n in size)
        and all(_is_int(n) and n >= 0 for n in stride)
        and storage_offset >= 0
        and type(requires_grad) is bool
    ):
        raise pickle.UnpicklingError("a tensor with a malformed size, stride or offset")
    if not (backward_hooks is None or (isinstance(backward_hooks, dict) and not backward_hooks)):
        raise pickle.UnpicklingError("a tensor with backward hooks")
    if not (metadata is None or (type(metadata) is dict and not metadata)):
        raise pickle.UnpicklingError("a tensor with metadata")
    itemsize = storage.dtype.itemsize
    held = storage.untyped.nbytes() // itemsize - storage_offset
    numel = math.prod(size)
    if numel > max(held, 0):
        raise pickle.UnpicklingError(
            f"a tensor of {numel} elements whose storage holds {max(held, 0)} after its offset"
        )
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) if numel else -1
    if (last + 1) * itemsize > storage.untyped.nbytes():
        raise pickle.UnpicklingError("a tensor reaching past the end of its storage")
    tensor = torch.empty((0,), dtype=storage.dtype)
    tensor.set_(storage.untyped, storage_offset, size, stride)
    return tensor


def _latin1(text: Any, encoding: Any) -> bytes:
    """``_codecs.encode`` for what protocols 0 to 2 pickle bytes as: latin-1 text."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode other than of text to latin-1")
    return text.encode("latin-1")


_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
    "UntypedStorage": torch.uint8,
}
_TENSOR_REBUILDS = frozenset(
    {("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2")}
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


def _storage_types() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    for name, dtype in _STORAGE_DTYPES.items():
        allowed["torch", name] = allowed["torch.cuda", name] = _StorageType(name, dtype)
    return allowed


# What a torch.save of a storage is made of (the bytes torch.storage._load_from_bytes gets).
STORAGE_ALLOW_LIST = AllowList(_storage_types(), "storages")


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
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed["torch", name] = value
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


def unpickle(data: bytes, owner: str, allowed: AllowList) -> Any:
    """Load a payload (a torch.save archive or stream, tensors on the CPU, or a bare
    pickle) with a restricted unpickler allowing ``allowed``, after describing it:
    anything it would import that is not allowed, anything unknown, or a payload too
    large to describe is refused before a byte of it is unpickled."""
    report = inspect_pickle(data, allowed)
    if not report.loadable:
        raise ValueError(f"{owner}: refusing to unpickle the extra state ({report})")
    try:
        if data.startswith(ZIP_MAGIC):
            return _load_archive(data, allowed)
        return _load_stream(data, allowed)
    except Exception as exc:
        raise ValueError(
            f"{owner}: could not unpickle the extra state ({report}): {escape(str(exc))}"
        ) from exc
