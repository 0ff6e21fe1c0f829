"""What the restricted unpickler builds for torch's globals: checked tensors and storages.

``_rebuild_tensor`` stands in for ``torch._utils._rebuild_tensor(_v2)``: every size,
stride and offset is checked against the bytes its storage holds before a view is made,
and the tensor is plain data (no hooks, no metadata, no ``requires_grad``). Storages are
``_Storage`` (bytes and a dtype), storage classes named in persistent ids
``_StorageType``; the callables it gives out (``_Allowed``) and these objects cannot be
changed by unpickling's ``BUILD``. ``STORAGE_ALLOW_LIST`` is what a ``torch.save`` of one
storage may hold; ``unpickling.py`` loads payloads with them.
"""

from __future__ import annotations

import collections
import math
import pickle
from typing import Any

import torch

from .pickle_model import AllowList


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


def torch_dtypes() -> dict[tuple[str, str], torch.dtype]:
    """Every ``torch.<dtype>`` global a pickle may name, to itself (a dtype is a value)."""
    return {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


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


def _storage_types() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    for name, dtype in _STORAGE_DTYPES.items():
        allowed["torch", name] = allowed["torch.cuda", name] = _StorageType(name, dtype)
    return allowed


# What a torch.save of a storage is made of (the bytes torch.storage._load_from_bytes gets).
STORAGE_ALLOW_LIST = AllowList(_storage_types(), "storages")
