"""Reading pickle opcode arguments exactly as CPython's ``_pickle`` reads them.

Each reader takes ``(buf, pos, end)`` and returns ``(value, position after)``, raising
``_Malformed`` where ``pickle`` would stop: ``INT`` in base 0 (``strtol`` then
``PyLong_FromString``), ``FLOAT`` without surrounding spaces, memo indices in base 10,
lines up to their newline, sized arguments checked against the bytes left. The pickle
machine (``pickle_machine.py``) looks readers up by pickletools' argument types
(``_READERS``) or, where ``_pickle`` reads a shared type its own way, by opcode
(``_OPCODE_READERS``).
"""

from __future__ import annotations

import codecs
import math
import re
import struct
import sys
from typing import Any

from .pickle_symbols import _Bytes, _Malformed, _Unknown


def _need(buf: bytes, pos: int, end: int, size: int) -> int:
    if size < 0 or pos + size > end:
        raise _Malformed(f"it ends inside an argument of {size} bytes")
    return pos + size


def _fixed(fmt: str) -> Any:
    unpack, size = struct.Struct(fmt).unpack_from, struct.calcsize(fmt)

    def read(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
        after = _need(buf, pos, end, size)
        return unpack(buf, pos)[0], after

    return read


def _sized(fmt: str, make: Any) -> Any:
    """An argument of ``length`` (packed as ``fmt``) bytes, turned into a value by ``make``."""
    length_of = _fixed(fmt)

    def read(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
        size, pos = length_of(buf, pos, end)
        if size < 0:  # LONG4: "LONG pickle has negative byte count"
            raise _Malformed("a negative byte count")
        after = _need(buf, pos, end, size)
        return make(buf, pos, after), after

    return read


def _line(buf: bytes, pos: int, end: int) -> tuple[bytes, int]:
    """A line argument without its newline (the unpickler reads it with the newline)."""
    stop = buf.find(b"\n", pos, end)
    if stop < 0:
        raise _Malformed("it ends inside a line argument")
    return buf[pos:stop], stop + 1


def _nonempty_line(buf: bytes, pos: int, end: int) -> tuple[bytes, int]:
    raw, pos = _line(buf, pos, end)
    if not raw:  # _pickle's bad_readline: "pickle data was truncated"
        raise _Malformed("an empty line argument")
    return raw, pos


def _utf8(raw: bytes, errors: str = "surrogatepass") -> str:
    try:
        return raw.decode("utf-8", errors)
    except UnicodeDecodeError as exc:
        raise _Malformed(f"a string that is not UTF-8 ({exc.reason})") from None


def _pickle_string(raw: bytes) -> Any:
    """STRING/BINSTRING: the unpickler decodes these with its ``encoding`` argument, which
    only agrees across loaders for ASCII."""
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        return _Unknown("a string whose value depends on the loader's encoding")


def _read_none(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
    return None, pos


# Python's int() syntax in base 0 and 10 (what PyLong_FromString accepts: surrounding ASCII
# whitespace, a sign, underscores between digits), for the C string up to its first NUL.
_SPACE = rb"[ \t\n\r\x0b\x0c]*"
_INT_BASE0 = re.compile(
    _SPACE + rb"[+-]?(?:0[xX](?:_?[0-9a-fA-F])+|0[oO](?:_?[0-7])+|0[bB](?:_?[01])+"
    rb"|[1-9](?:_?[0-9])*|0(?:_?0)*)" + _SPACE
)
_INT_BASE10 = re.compile(_SPACE + rb"[+-]?[0-9](?:_?[0-9])*" + _SPACE)
_STRTOL_DIGITS = {8: b"01234567", 10: b"0123456789", 16: b"0123456789abcdefABCDEF"}
_LONG_MAX = (1 << 63) - 1  # C long on the LP64 platforms torch runs on


def _c_string(raw: bytes) -> bytes:
    """What C code sees of a line: the bytes before the first NUL."""
    return raw.partition(b"\0")[0]


def _pylong_parses(raw: bytes, base: int) -> bool:
    """Whether ``PyLong_FromString(raw, NULL, base)`` returns an int (base 0 or 10)."""
    text = _c_string(raw)
    if (_INT_BASE0 if base == 0 else _INT_BASE10).fullmatch(text) is None:
        return False
    digits = text.strip(b" \t\n\r\x0b\x0c+-").replace(b"_", b"")
    limit = sys.get_int_max_str_digits()  # decimal only: the other bases are powers of 2
    decimal = base == 10 or not digits[1:2].isalpha()
    return not (decimal and limit and len(digits) > max(limit, 640))


def _strtol_parses(raw: bytes) -> bool:
    """Whether C's ``strtol(s, &end, 0)`` converts ``s`` without overflow and stops at
    the newline or a NUL (what ``INT`` tries first)."""
    i, n = 0, len(raw)
    while i < n and raw[i] in b" \t\r\x0b\x0c\n":
        i += 1
    negative = i < n and raw[i] == ord("-")
    if i < n and raw[i] in b"+-":
        i += 1
    if raw[i : i + 2] in (b"0x", b"0X") and raw[i + 2 : i + 3] and raw[i + 2] in _STRTOL_DIGITS[16]:
        base, i = 16, i + 2
    else:
        base = 8 if raw[i : i + 1] == b"0" else 10
    j = i
    while j < n and raw[j] in _STRTOL_DIGITS[base]:
        j += 1
    if j == i:  # no conversion: strtol's end is the start of the string
        return raw[:1] == b"\0"
    if j < n and raw[j] != 0:
        return False
    significant = raw[i:j].lstrip(b"0")
    if len(significant) > 24:  # more than 64 bits in any of the three bases
        return False
    value = int(significant or b"0", base)
    return value <= _LONG_MAX + negative


def _read_int(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
    """INT: ``strtol`` in base 0, else ``PyLong_FromString`` in base 0 (so ``I0x10``,
    ``I010`` and ``I1_0`` are all numbers)."""
    raw, pos = _nonempty_line(buf, pos, end)
    if not (_strtol_parses(raw) or _pylong_parses(raw, 0)):
        raise _Malformed("a malformed INT argument")
    return None, pos


def _read_long(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
    """LONG: an optional trailing ``L`` dropped, then ``PyLong_FromString`` in base 0."""
    raw, pos = _nonempty_line(buf, pos, end)
    if not _pylong_parses(raw[:-1] if raw.endswith(b"L") else raw, 0):
        raise _Malformed("a malformed LONG argument")
    return None, pos


def _read_memo_index(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
    """GET and PUT: ``PyLong_FromString`` in base 10."""
    raw, pos = _nonempty_line(buf, pos, end)
    if not _pylong_parses(raw, 10):
        raise _Malformed("a malformed memo index")
    return int(_c_string(raw)), pos


# What PyOS_string_to_double reads: no surrounding spaces, no underscores, no hex.
_FLOAT = re.compile(
    rb"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf(?:inity)?|nan))"
)


def _read_float(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
    """FLOAT: a number at the very start of the line, followed by the newline or a NUL,
    that does not overflow (``1e999`` is an OverflowError; ``inf`` is a number)."""
    raw, pos = _nonempty_line(buf, pos, end)
    match = _FLOAT.match(raw)
    if match is None or raw[match.end() : match.end() + 1] not in (b"", b"\0"):
        raise _Malformed("a malformed FLOAT argument")
    text = match.group()
    if float(text) in (math.inf, -math.inf) and not text.lstrip(b"+-")[:1].isalpha():
        raise _Malformed("a FLOAT argument too large for a float")
    return None, pos


def _read_quoted(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
    raw, pos = _line(buf, pos, end)
    if len(raw) < 2 or raw[0] != raw[-1] or raw[:1] not in (b"'", b'"'):
        raise _Malformed("a STRING argument without matching quotes")
    try:
        value = codecs.escape_decode(raw[1:-1])[0]  # type: ignore[attr-defined]
    except ValueError as exc:
        raise _Malformed(f"a malformed STRING argument ({exc})") from None
    return _pickle_string(value), pos


def _read_unicode_line(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
    raw, pos = _line(buf, pos, end)
    try:
        return raw.decode("raw-unicode-escape"), pos
    except UnicodeDecodeError as exc:
        raise _Malformed(f"a malformed UNICODE argument ({exc.reason})") from None


def _read_persistent_id(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
    raw, pos = _line(buf, pos, end)
    if not raw.isascii():
        raise _Malformed("a persistent id that is not ASCII")
    return None, pos


def _global_pair(encoding: str) -> Any:
    """GLOBAL (UTF-8) and INST (ASCII): two non-empty lines, strictly decoded."""

    def read(buf: bytes, pos: int, end: int) -> tuple[Any, int]:
        module, pos = _nonempty_line(buf, pos, end)
        name, pos = _nonempty_line(buf, pos, end)
        try:
            return (module.decode(encoding), name.decode(encoding)), pos
        except UnicodeDecodeError as exc:
            raise _Malformed(f"a global name that is not {encoding} ({exc.reason})") from None

    return read


_READERS = {
    None: _read_none,
    "uint1": _fixed("<B"),
    "uint2": _fixed("<H"),
    "int4": _fixed("<i"),
    "uint4": _fixed("<I"),
    "uint8": _fixed("<Q"),
    "float8": _fixed("<d"),
    "long1": _sized("<B", lambda buf, start, end: None),
    "long4": _sized("<i", lambda buf, start, end: None),
    "string1": _sized("<B", lambda buf, start, end: _pickle_string(buf[start:end])),
    # pickletools says signed; _pickle reads BINSTRING's length unsigned
    "string4": _sized("<I", lambda buf, start, end: _pickle_string(buf[start:end])),
    "bytes1": _sized("<B", _Bytes),
    "bytes4": _sized("<I", _Bytes),
    "bytes8": _sized("<Q", _Bytes),
    "bytearray8": _sized("<Q", _Bytes),
    "unicodestring1": _sized("<B", lambda buf, start, end: _utf8(buf[start:end])),
    "unicodestring4": _sized("<I", lambda buf, start, end: _utf8(buf[start:end])),
    "unicodestring8": _sized("<Q", lambda buf, start, end: _utf8(buf[start:end])),
    "stringnl": _read_quoted,
    "stringnl_noescape": _read_persistent_id,
    "unicodestringnl": _read_unicode_line,
}


# Where _pickle reads an argument type pickletools shares between opcodes its own way.
_OPCODE_READERS = {
    "INT": _read_int,
    "LONG": _read_long,
    "FLOAT": _read_float,
    "GET": _read_memo_index,
    "PUT": _read_memo_index,
    "GLOBAL": _global_pair("utf-8"),
    "INST": _global_pair("ascii"),
}
