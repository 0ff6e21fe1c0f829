"""Entries DCP saved as bytes (a ``torch.save`` of a value that is not a tensor), loaded
with the restricted unpickler (``ENTRY_ALLOW_LIST``: plain data, tensors and byte buffers),
never with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from ..unpickled_torch import _Allowed
from ..unpickling import TORCH_ALLOW_LIST, unpickle

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
