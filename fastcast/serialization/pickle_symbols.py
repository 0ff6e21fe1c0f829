"""What the pickle model computes with, and where it stops.

The model (``pickle_payloads.py``, ``pickle_machine.py``) runs the pickle machine over
symbols instead of objects: ``_Global`` (a global the pickle imported), ``_Result``
(what calling one returned), ``_Unknown`` (a value only known at load time), ``_Bytes``
(a slice of the payload, not copied), ``_DATA`` (any other data) and ``_NOTHING`` (what
an ordinary unpickler would fail on). Describing stops with ``_TooLarge`` past one of
the caps below, or ``_Malformed`` where ``pickle`` itself would stop.
"""

from __future__ import annotations

import _compat_pickle

ZIP_MAGIC = b"PK\x03\x04"  # how every torch.save archive starts

# Caps on describing: the bytes of a payload looked at, the bytes of pickle read (nested
# and archived pickles included), the opcodes modelled, the memo, how deep payloads may
# nest, and the size and entries of a zip archive (Python's zipfile reads the whole
# central directory at once).
_MAX_PAYLOAD = 64 << 20
_MAX_PICKLE_BYTES = 16 << 20
_MAX_ARCHIVE = 16 << 20
_MAX_OPCODES = 200_000
_MAX_MEMO = 50_000
_MAX_NESTING = 3
_MAX_ZIP_ENTRIES = 1024
_MAX_GLOBALS = 1024

# A legacy torch.save stream is five pickles (magic number, protocol, system information,
# the object, the storage keys) followed by raw storage bytes.
_MAX_PICKLES_PER_STREAM = 5

# What the description shows.
_SHOWN_GLOBALS = 40
_SHOWN_CHARS = 120
_SHOWN_REASONS = 6
_KEPT_NOTES = 64  # reasons for "unknown" and malformed pickles kept, of which some are shown


class _TooLarge(Exception):
    pass


class _Malformed(Exception):
    """A pickle an ordinary unpickler would stop reading at ``at``."""

    def __init__(self, message: str, at: int = -1) -> None:
        super().__init__(message)
        self.at = at


# The symbols the model's stack holds. Strings are ``str``, tuples are ``tuple`` (their
# items are what REDUCE and friends are given); any other data is ``_DATA``.
class _Global:
    """A global the pickle imported."""

    __slots__ = ("key", "shown", "written")

    def __init__(self, key: str | None, shown: str, written: tuple[str, str]) -> None:
        self.key = key  # module.name, as imported; None when too long to be a real one
        self.shown = shown
        self.written = written  # (module, name) as the pickle spells them


class _Result:
    """What calling (or instantiating) a global returned."""

    __slots__ = ("source", "state_set")

    def __init__(self, source: _Global) -> None:
        self.source = source
        self.state_set = False


class _Unknown:
    """A value only known at load time (a persistent reference, say)."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what


class _Bytes:
    """Bytes the pickle holds: a slice of a buffer, not copied."""

    __slots__ = ("buf", "start", "end")

    def __init__(self, buf: bytes, start: int, end: int) -> None:
        self.buf, self.start, self.end = buf, start, end


_DATA = object()  # numbers, None, lists, dicts, sets: what no global can hide in as a name
_NOTHING = object()  # what an ordinary unpickler fails on (an empty stack, a missing memo entry)


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _old_name(module: str, name: str) -> tuple[str, str]:
    """The Python 3 name of a Python 2 global, as pickle maps it for protocols 0 to 2."""
    mapped = _compat_pickle.NAME_MAPPING.get((module, name))
    if mapped is not None:
        return mapped
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name
