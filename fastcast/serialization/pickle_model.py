"""Reading pickles without trusting them, and unpickling only what an allow-list names.

``describe_pickle`` says what a payload would import and call, found by running a model
of the pickle machine over its opcodes: the stack, marks and memo hold symbols instead of
objects, and nothing is imported or called. The payload may be a bare pickle, a
``torch.save`` zip archive (every ``*.pkl`` entry is read) or a legacy ``torch.save``
stream (several pickles in a row), and the bytes handed to
``torch.storage._load_from_bytes`` (how a tensor pickles outside ``torch.save``) are
described in turn. Every opcode argument is parsed as CPython's ``_pickle`` parses it
(``INT`` in base 0, ``FLOAT`` without surrounding spaces, ...), and a pickle read from a
file (``torch.load``) is followed frame by frame as that unpickler reads it, so the model
stops where ``pickle`` stops and nowhere else. Describing is bounded: past the caps below
the answer is "too large to describe", and where the model cannot know what would run
(a global whose name is computed at load time, say) the answer says "unknown" rather than
listing only what it could see.

Given an ``AllowList`` (what a restricted unpickler would give for each global), the
description also lists what that unpickler refuses. Loading is ``unpickling.py``; this
module knows nothing of any library's format (``schemes/delayed/te_state.py`` adds
TransformerEngine's).
"""

from __future__ import annotations

import _compat_pickle
import codecs
import ctypes
import io
import math
import pickle
import pickletools
import re
import struct
import sys
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

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

# The loaders that unpickle bytes given to them: what they are given is described too.
_NESTED_LOADERS = frozenset({"torch.storage._load_from_bytes", "pickle.loads", "_pickle.loads"})


# -- the payload's bytes ----------------------------------------------------------------------
def payload_bytes(payload: Any) -> bytes:
    """The bytes of a payload: ``bytes``, ``bytearray``, ``io.BytesIO`` or a uint8 tensor."""
    if isinstance(payload, io.BytesIO):
        return payload.getvalue()
    if isinstance(payload, torch.Tensor):
        return _tensor_bytes(payload)
    return bytes(payload)


def _payload_size(payload: Any) -> int:
    if isinstance(payload, io.BytesIO):
        with payload.getbuffer() as view:
            return view.nbytes
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    with memoryview(payload) as view:
        return view.nbytes


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes in one copy, without NumPy (which torch does not require) and
    without ``.tolist()`` (a Python int per byte)."""
    flat = tensor.detach().reshape(-1).cpu().contiguous()
    size = flat.numel() * flat.element_size()
    if size == 0:
        return b""
    address = flat.data_ptr()
    if not address:
        raise ValueError("a tensor without CPU memory to read the payload from")
    return ctypes.string_at(address, size)


# -- describing ---------------------------------------------------------------------------------
class PickleReport:
    """What ``inspect_pickle`` found: the globals a payload imports (in order, each with
    how it is used), the reasons what it would run is unknown, and whether it was too
    large to describe. ``str()`` gives the description."""

    __slots__ = ("size", "kind", "imports", "refused", "unknown", "failures", "too_large", "nested")

    def __init__(self, size: int, kind: str) -> None:
        self.size = size
        self.kind = kind
        self.imports: dict[str, dict[str, None]] = {}  # shown name -> how it is used
        self.refused: dict[str, None] = {}  # globals the restricted unpickler refuses
        self.unknown: dict[str, None] = {}  # why what it would run is unknown
        self.failures: list[str] = []  # where an ordinary unpickler would fail
        self.too_large: str | None = None
        self.nested = 0  # payloads found nested in it

    @property
    def loadable(self) -> bool:
        """Whether the restricted loader may try it: described in full, well formed,
        nothing unknown, and every global one that it allows."""
        return not (self.too_large or self.unknown or self.refused or self.failures)

    def __str__(self) -> str:
        head = f"{self.size}-byte {self.kind}"
        if self.nested:
            head += f" with {self.nested} nested pickled payload{'s' * (self.nested > 1)}"
        listing = self._listing()
        if self.too_large is not None:
            text = f"{head}, too large to describe ({self.too_large})"
            if listing:
                text += f"; the part read imports {listing}"
        elif self.unknown:
            shown = list(self.unknown)[:_SHOWN_REASONS]
            more = len(self.unknown) - len(shown)
            text = f"{head}; what it would run is unknown: it {'; it '.join(shown)}"
            text += f" (and {more} more)" if more else ""
            if listing:
                text += f"; it imports at least {listing}"
        elif listing:
            text = f"{head} importing {listing}"
        else:
            text = f"{head}, importing nothing"
        if self.failures:
            text += f"; an ordinary unpickler would stop where the {self.failures[0]}"
        if self.refused:
            refused = _enumerate(list(self.refused))
            text += f"; not allowed even inside fc.allow_unsafe_extra_state(): {refused}"
        return escape(text)

    def _listing(self) -> str:
        return _enumerate(
            [f"{name} ({', '.join(uses)})" if uses else name for name, uses in self.imports.items()]
        )


def escape(text: str) -> str:
    """``text`` with every character a terminal would not print as itself (ESC, CR,
    bidirectional overrides, zero-width characters) written as ``repr`` writes it: a
    name in a payload must not be able to hide or rewrite the message that names it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _enumerate(items: list[str]) -> str:
    """'a, b and c', at most ``_SHOWN_GLOBALS`` of them."""
    if len(items) > _SHOWN_GLOBALS:
        items = [*items[:_SHOWN_GLOBALS], f"{len(items) - _SHOWN_GLOBALS} more"]
    if len(items) > 1:
        return f"{', '.join(items[:-1])} and {items[-1]}"
    return items[0] if items else ""


def inspect_pickle(payload: Any, allowed: AllowList | None = None) -> PickleReport:
    """Describe a payload (bytes, ``BytesIO`` or uint8 tensor) without executing it;
    with ``allowed``, also what a restricted unpickler allowing that would refuse."""
    size = _payload_size(payload)
    if size > _MAX_PAYLOAD:
        report = PickleReport(size, "payload")
        report.too_large = f"over {_MAX_PAYLOAD >> 20} MiB"
        return report
    data = payload_bytes(payload)
    zipped = data.startswith(ZIP_MAGIC)
    report = PickleReport(size, "torch.save archive" if zipped else "pickle")
    model = _Model(report, allowed)
    try:
        if zipped:
            model.archive(data, 0, len(data), depth=0)
        else:
            model.stream(data, 0, len(data), depth=0, where="pickle")
    except _TooLarge as exc:
        report.too_large = str(exc)
    except Exception as exc:  # noqa: BLE001 - a fault of the model must not pass as a description
        report.unknown[f"could not be described ({type(exc).__name__}: {exc})"] = None
    return report


def describe_pickle(payload: Any, allowed: AllowList | None = None) -> str:
    """What a payload would import and call, read without executing anything."""
    return str(inspect_pickle(payload, allowed))


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


class _Model:
    """Describes the payloads of one report, spending one budget across all of them."""

    def __init__(self, report: PickleReport, allowed: AllowList | None) -> None:
        self.report = report
        self.allowed = allowed
        self.opcodes = 0
        self.pickle_bytes = 0

    def spend(self, size: int, what: str) -> None:
        self.pickle_bytes += size
        if self.pickle_bytes > _MAX_PICKLE_BYTES:
            raise _TooLarge(f"over {_MAX_PICKLE_BYTES >> 20} MiB of pickle to read, at {what}")

    def reason(self, text: str) -> None:
        if len(self.report.unknown) < _KEPT_NOTES:
            self.report.unknown[text] = None

    # -- what the opcodes do ----------------------------------------------------------------
    def import_global(self, module: str, name: str, proto: int) -> _Global:
        written = (module, name)
        if proto < 3:  # pickle.Unpickler's fix_imports, on by default
            module, name = _old_name(module, name)
        if len(module) + len(name) > 4 * _SHOWN_CHARS:
            key, shown = None, f"{_clip(module)}.{_clip(name)}"
        else:
            key = f"{module}.{name}"
            shown = _clip(key)
        uses = self.report.imports.get(shown)
        if uses is None:
            if len(self.report.imports) >= _MAX_GLOBALS:
                raise _TooLarge(f"over {_MAX_GLOBALS} different globals")
            uses = self.report.imports[shown] = {}
        if written != (module, name):
            uses[f"written {_clip('.'.join(written))}"] = None
        if self.allowed is not None and self.allowed.get(*written) is None:
            self.report.refused[shown] = None
        return _Global(key, shown, written)

    def call(self, func: Any, args: Any, depth: int) -> Any:
        if isinstance(func, _Global):
            self.report.imports[func.shown]["called"] = None
            if func.key in _NESTED_LOADERS:
                data = args[0] if isinstance(args, tuple) and args else None
                if isinstance(data, _Bytes):
                    self.nested(data, depth + 1)
                else:
                    self.reason(f"gives {func.shown} data computed at load time")
            elif func.key == "_codecs.encode":
                encoded = self.latin1(args)
                if encoded is not None:
                    return encoded
            return _Result(func)
        if isinstance(func, _Result):
            self.reason(f"calls what {func.source.shown} returned")
            return _Unknown(f"the result of calling what {func.source.shown} returned")
        if isinstance(func, _Unknown):
            self.reason(f"calls {func.what}")
            return _Unknown(f"the result of calling {func.what}")
        return _NOTHING  # not callable: an ordinary unpickler stops here

    def latin1(self, args: Any) -> _Bytes | None:
        """``_codecs.encode(text, "latin1")``: how protocols 0 to 2 pickle bytes. Each
        call makes new bytes, so each is paid for from the byte budget (a memoized text
        encoded in a loop would otherwise make gigabytes from kilobytes)."""
        if (
            isinstance(args, tuple)
            and len(args) == 2
            and isinstance(args[0], str)
            and args[1] in ("latin1", "latin-1")
        ):
            self.spend(len(args[0]), "_codecs.encode")
            try:
                data = args[0].encode("latin-1")
            except UnicodeEncodeError:
                return None
            return _Bytes(data, 0, len(data))
        return None

    def change(self, target: Any, how: str) -> None:
        """``BUILD`` (how="sets the state of") or adding items to ``target``."""
        if isinstance(target, _Result) and self.allowed is not None:
            # What the restricted unpickler would make of it may only be changed as the
            # allow-list says (a tensor given a state would call Tensor.__setstate__).
            if not self.allowed.permits(*target.source.written, build=how == "sets the state of"):
                self.report.refused[f"{how} a {target.source.shown} object"] = None
        if isinstance(target, _Global):
            self.report.imports[target.shown]["modified"] = None
            self.reason(f"changes {target.shown} itself")
        elif isinstance(target, _Result):
            if target.state_set:
                # Setting an instance's state can give it attributes (a __setstate__, an
                # append) that the next BUILD or APPEND calls: anything.
                self.reason(f"{how} a {target.source.shown} object whose state it already set")
            if how == "sets the state of":
                target.state_set = True
        elif isinstance(target, _Unknown):
            self.reason(f"{how} {target.what}")

    # -- payloads ---------------------------------------------------------------------------
    def nested(self, data: _Bytes, depth: int) -> None:
        if depth > _MAX_NESTING:
            raise _TooLarge(f"payloads nested over {_MAX_NESTING} deep")
        self.report.nested += 1
        if data.buf.startswith(ZIP_MAGIC, data.start, data.end):
            self.archive(data.buf, data.start, data.end, depth)
        else:
            self.stream(data.buf, data.start, data.end, depth, where="nested pickle")

    def stream(self, buf: bytes, start: int, end: int, depth: int, where: str) -> None:
        """Pickles one after another, as ``torch.load`` reads a legacy stream."""
        self.spend(end - start, where)
        pos, count = start, 0
        while pos < end and count < _MAX_PICKLES_PER_STREAM:
            try:
                pos = _Machine(self, depth).run(buf, pos, end)
            except _Malformed as exc:
                if count == 0 or exc.at != pos:  # else: trailing bytes, not a pickle
                    at = exc.at - start
                    if len(self.report.failures) < _KEPT_NOTES:
                        self.report.failures.append(f"{where} is malformed at byte {at}: {exc}")
                return
            count += 1

    def archive(self, buf: bytes, start: int, end: int, depth: int) -> None:
        """Every ``*.pkl`` entry of a zip archive (a decoy entry must not hide the real one)."""
        if end - start > _MAX_ARCHIVE:
            raise _TooLarge(f"a zip archive over {_MAX_ARCHIVE >> 20} MiB")
        data = buf if (start, end) == (0, len(buf)) else buf[start:end]
        if depth:
            self.spend(len(data), "a nested zip archive")
        entries = data.count(b"PK\x01\x02")  # an upper bound on the central directory's entries
        if entries > _MAX_ZIP_ENTRIES:
            raise _TooLarge(f"a zip archive with over {_MAX_ZIP_ENTRIES} entries")
        try:
            archive = zipfile.ZipFile(io.BytesIO(data))
        except _ZIP_ERRORS as exc:
            self.reason(f"is a zip archive Python's zipfile cannot read ({exc})")
            return
        with archive:
            for info in archive.infolist():
                name = info.filename
                if name == "constants.pkl" or name.endswith("/constants.pkl"):
                    self.reason(
                        "is a TorchScript archive, which torch.load hands to torch.jit.load "
                        "(running its code)"
                    )
                if name.endswith(".pkl"):
                    self.archived_pickle(archive, info, depth)

    def archived_pickle(self, archive: zipfile.ZipFile, info: zipfile.ZipInfo, depth: int) -> None:
        where = f"entry {_clip(info.filename)!r}"
        if info.flag_bits & 0x1:
            self.reason(f"holds an encrypted {where}")
            return
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            self.reason(f"holds {where} compressed in a way torch does not read")
            return
        room = _MAX_PICKLE_BYTES - self.pickle_bytes
        if info.file_size > room:
            raise _TooLarge(f"{where} holds {info.file_size} bytes")
        try:
            with archive.open(info) as entry:
                data = entry.read(room + 1)  # the header's size may lie; never read past room
        except _ZIP_ERRORS as exc:
            self.reason(f"holds {where}, which cannot be read ({exc})")
            return
        if len(data) > room:
            raise _TooLarge(f"{where} holds more than {room} bytes")
        self.stream(data, 0, len(data), depth, where=where)


# What reading a damaged or unusual zip archive raises (NotImplementedError: a zip feature
# Python's zipfile lacks; RuntimeError: encryption; OverflowError: an absurd offset).
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    NotImplementedError,
    RuntimeError,
    OverflowError,
    OSError,
    ValueError,
    EOFError,
    zlib.error,
)


class _Machine:
    """One pickle's stack, marks and memo, as an unpickler holds them, but of symbols.

    Opcode arguments are read as CPython's ``_pickle`` reads them, so the model stops
    exactly where a malformed argument stops ``pickle``. Where an ordinary unpickler would
    fail on the stack instead (popping an empty stack, a missing mark) the model goes on
    with ``_NOTHING``: it may report more than would run, never
    less.

    Frames: ``pickle.loads`` reads bytes in place, while an unpickler reading a file (how
    ``torch.load`` reads a legacy stream) reads a whole ``FRAME`` at once, so after a
    ``STOP`` inside a frame the next pickle of the stream starts at the frame's end, and
    an argument read across a frame's end is read from elsewhere. The model follows the
    first, and says "unknown" for the second (no pickler writes it).
    """

    __slots__ = ("model", "depth", "stack", "marks", "memo", "proto", "frame_end")

    def __init__(self, model: _Model, depth: int) -> None:
        self.model = model
        self.depth = depth
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.proto = 0
        self.frame_end: int | None = None  # where the frame read from a file ends

    def run(self, buf: bytes, pos: int, end: int) -> int:
        """Model the pickle at ``pos``; return where an unpickler reading a file would
        be once it returns (after STOP, or after the frame STOP is in)."""
        model = self.model
        while True:
            at = pos
            if pos >= end:
                raise _Malformed("it ends before STOP", at)
            if pos == self.frame_end:  # the frame is used up: reads go to the file again
                self.frame_end = None
            code = buf[pos]
            op = _OPS[code]
            if op is None:
                raise _Malformed(f"unknown opcode {code:#04x}", at)
            model.opcodes += 1
            if model.opcodes > _MAX_OPCODES:
                raise _TooLarge(f"over {_MAX_OPCODES} opcodes")
            reader, handler = op
            try:
                arg, pos = reader(buf, pos + 1, end)
                if handler is not None and handler is not _FRAME:
                    handler(self, arg)
            except _Malformed as exc:
                raise _Malformed(str(exc), at) from None
            if self.frame_end is not None and pos > self.frame_end:
                model.reason(
                    "reads an argument across the end of a frame (read one way by "
                    "pickle.loads and another by an unpickler reading a file)"
                )
            if handler is None:  # STOP
                return pos if self.frame_end is None else max(pos, self.frame_end)
            if handler is _FRAME:
                self.frame(arg, pos, end, at)

    def frame(self, size: int, pos: int, end: int, at: int) -> None:
        """FRAME: the unpickler checks that ``size`` bytes follow (and, reading a file,
        reads them at once unless they are already read)."""
        if pos + size > end:
            raise _Malformed(f"it ends inside a frame of {size} bytes", at)
        if self.frame_end is None:
            self.frame_end = pos + size if size else None
        elif pos + size > self.frame_end:
            self.model.reason("starts a frame that crosses the end of the frame it is in")

    # -- the stack --------------------------------------------------------------------------
    def push(self, value: Any) -> None:
        self.stack.append(value)

    def pop(self) -> Any:
        return self.stack.pop() if self.stack else _NOTHING

    def top(self) -> Any:
        return self.stack[-1] if self.stack else _NOTHING

    def pop_mark(self) -> list[Any]:
        items = self.stack
        self.stack = self.marks.pop() if self.marks else []
        return items

    def remember(self, index: int) -> None:
        if index < 0:
            raise _Malformed("a negative memo index")
        if index >= _MAX_MEMO or (index not in self.memo and len(self.memo) >= _MAX_MEMO):
            raise _TooLarge(f"over {_MAX_MEMO} memo entries")
        self.memo[index] = self.top()

    # -- opcodes ----------------------------------------------------------------------------
    def op_data(self, arg: Any) -> None:
        self.stack.append(_DATA)

    def op_value(self, arg: Any) -> None:  # strings and bytes: the value read
        self.stack.append(arg)

    def op_empty_tuple(self, arg: Any) -> None:
        self.stack.append(())

    def op_mark(self, arg: Any) -> None:
        self.marks.append(self.stack)
        self.stack = []

    def op_tuple(self, arg: Any) -> None:
        self.push(tuple(self.pop_mark()))

    def op_tuple1(self, arg: Any) -> None:
        self.push((self.pop(),))

    def op_tuple2(self, arg: Any) -> None:
        second = self.pop()
        self.push((self.pop(), second))

    def op_tuple3(self, arg: Any) -> None:
        third, second = self.pop(), self.pop()
        self.push((self.pop(), second, third))

    def op_collect(self, arg: Any) -> None:  # LIST, DICT, FROZENSET
        self.pop_mark()
        self.push(_DATA)

    def op_append(self, arg: Any) -> None:
        self.pop()
        self.model.change(self.top(), "adds items to")

    def op_setitem(self, arg: Any) -> None:
        self.pop()
        self.pop()
        self.model.change(self.top(), "adds items to")

    def op_add_marked(self, arg: Any) -> None:  # APPENDS, SETITEMS, ADDITEMS
        self.pop_mark()
        self.model.change(self.top(), "adds items to")

    def op_pop(self, arg: Any) -> None:
        if self.stack:
            self.stack.pop()
        else:  # what pickle does too: an empty stack above a mark pops the mark
            self.pop_mark()

    def op_pop_mark(self, arg: Any) -> None:
        self.pop_mark()

    def op_dup(self, arg: Any) -> None:
        self.push(self.top())

    def op_get(self, arg: Any) -> None:
        if arg not in self.memo:  # where pickle stops: "Memo value not found at index"
            raise _Malformed(f"it reads memo entry {arg}, never stored")
        self.push(self.memo[arg])

    def op_put(self, arg: Any) -> None:
        self.remember(arg)

    def op_memoize(self, arg: Any) -> None:
        self.remember(len(self.memo))

    def op_global(self, arg: Any) -> None:
        self.push(self.model.import_global(arg[0], arg[1], self.proto))

    def op_stack_global(self, arg: Any) -> None:
        name, module = self.pop(), self.pop()
        if isinstance(module, str) and isinstance(name, str):
            self.push(self.model.import_global(module, name, self.proto))
        else:
            self.model.reason("imports a global whose name is computed at load time")
            self.push(_Unknown("a global whose name is computed at load time"))

    def op_inst(self, arg: Any) -> None:
        func = self.model.import_global(arg[0], arg[1], self.proto)
        self.push(self.model.call(func, tuple(self.pop_mark()), self.depth))

    def op_obj(self, arg: Any) -> None:
        items = self.pop_mark()
        if items:
            self.push(self.model.call(items[0], tuple(items[1:]), self.depth))
        else:
            self.push(_NOTHING)

    def op_reduce(self, arg: Any) -> None:
        args = self.pop()
        self.push(self.model.call(self.pop(), args, self.depth))

    def op_newobj(self, arg: Any) -> None:
        args = self.pop()
        self.push(self.model.call(self.pop(), args, self.depth))

    def op_newobj_ex(self, arg: Any) -> None:
        self.pop()  # keyword arguments
        args = self.pop()
        self.push(self.model.call(self.pop(), args, self.depth))

    def op_build(self, arg: Any) -> None:
        self.pop()
        self.model.change(self.top(), "sets the state of")

    def op_persid(self, arg: Any) -> None:
        self.push(_Unknown("a persistent reference"))

    def op_binpersid(self, arg: Any) -> None:
        self.pop()
        self.push(_Unknown("a persistent reference"))

    def op_ext(self, arg: Any) -> None:
        self.model.reason(f"imports the global registered with copyreg under code {arg}")
        self.push(_Unknown("a global registered with copyreg"))

    def op_proto(self, arg: Any) -> None:
        if arg > pickle.HIGHEST_PROTOCOL:  # where pickle stops: "unsupported pickle protocol"
            raise _Malformed(f"unsupported pickle protocol {arg}")
        self.proto = arg

    def op_nothing(self, arg: Any) -> None:  # READONLY_BUFFER
        pass


# -- reading opcode arguments, as CPython's _pickle reads them -----------------------------
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

_M = _Machine
_FRAME = object()  # FRAME is handled by the machine's run loop itself
_HANDLERS = {
    "STOP": None,
    "FRAME": _FRAME,
    **dict.fromkeys(
        (
            "NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT "
            "EMPTY_LIST EMPTY_DICT EMPTY_SET NEXT_BUFFER"
        ).split(),
        _M.op_data,
    ),
    **dict.fromkeys(
        (
            "STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8 "
            "BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8"
        ).split(),
        _M.op_value,
    ),
    "EMPTY_TUPLE": _M.op_empty_tuple,
    "MARK": _M.op_mark,
    "TUPLE": _M.op_tuple,
    "TUPLE1": _M.op_tuple1,
    "TUPLE2": _M.op_tuple2,
    "TUPLE3": _M.op_tuple3,
    **dict.fromkeys(("LIST", "DICT", "FROZENSET"), _M.op_collect),
    "APPEND": _M.op_append,
    "SETITEM": _M.op_setitem,
    **dict.fromkeys(("APPENDS", "SETITEMS", "ADDITEMS"), _M.op_add_marked),
    "POP": _M.op_pop,
    "POP_MARK": _M.op_pop_mark,
    "DUP": _M.op_dup,
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), _M.op_get),
    **dict.fromkeys(("PUT", "BINPUT", "LONG_BINPUT"), _M.op_put),
    "MEMOIZE": _M.op_memoize,
    "GLOBAL": _M.op_global,
    "STACK_GLOBAL": _M.op_stack_global,
    "INST": _M.op_inst,
    "OBJ": _M.op_obj,
    "REDUCE": _M.op_reduce,
    "NEWOBJ": _M.op_newobj,
    "NEWOBJ_EX": _M.op_newobj_ex,
    "BUILD": _M.op_build,
    "PERSID": _M.op_persid,
    "BINPERSID": _M.op_binpersid,
    **dict.fromkeys(("EXT1", "EXT2", "EXT4"), _M.op_ext),
    "PROTO": _M.op_proto,
    "READONLY_BUFFER": _M.op_nothing,
}


def _unmodelled(name: str) -> Any:
    def handler(machine: _Machine, arg: Any) -> None:
        machine.model.reason(f"uses the opcode {name}, which fastcast does not model")
        machine.push(_Unknown(f"what {name} pushes"))

    return handler


def _opcode_table() -> list[Any]:
    """Per opcode byte: (argument reader, handler), from pickletools' list of opcodes so
    that an opcode added to pickle later is read (and reported as unknown), not misread
    (an argument type without a reader here fails at import, in fastcast's tests)."""
    table: list[Any] = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg.name if op.arg is not None else None
        reader = _OPCODE_READERS.get(op.name) or _READERS[arg]
        handler = _HANDLERS[op.name] if op.name in _HANDLERS else _unmodelled(op.name)
        table[op.code.encode("latin-1")[0]] = (reader, handler)
    return table


_OPS = _opcode_table()


# -- what a restricted unpickler allows ----------------------------------------------------------
class AllowList:
    """What a restricted unpickler gives for each global it allows, and which of what they
    make the pickle may change: ``buildable`` results may be given a state (``BUILD``),
    ``containers`` may be given items (``SETITEMS``, ``APPENDS``...). ``what`` says in
    words what is allowed, for refusals. Python 2 spellings of a global are looked up as
    pickle maps them (whatever the protocol: both spellings give only something allowed).
    """

    __slots__ = ("globals", "buildable", "containers", "what")

    def __init__(
        self,
        globals_: Mapping[tuple[str, str], Any],
        what: str,
        buildable: Iterable[tuple[str, str]] = (),
        containers: Iterable[tuple[str, str]] = (),
    ) -> None:
        self.globals = dict(globals_)
        self.buildable = frozenset(buildable)
        self.containers = frozenset(containers)
        self.what = what

    def extended(
        self,
        globals_: Mapping[tuple[str, str], Any],
        what: str,
        buildable: Iterable[tuple[str, str]] = (),
        containers: Iterable[tuple[str, str]] = (),
    ) -> AllowList:
        """This allow-list with more globals."""
        return AllowList(
            {**self.globals, **globals_},
            what,
            self.buildable | frozenset(buildable),
            self.containers | frozenset(containers),
        )

    def _key(self, module: str, name: str) -> tuple[str, str] | None:
        if (module, name) in self.globals:
            return (module, name)
        mapped = _old_name(module, name)
        return mapped if mapped in self.globals else None

    def get(self, module: str, name: str) -> Any:
        """What the unpickler gives for the global, or None if it refuses it."""
        key = self._key(module, name)
        return None if key is None else self.globals[key]

    def permits(self, module: str, name: str, build: bool) -> bool:
        """Whether what calling the global makes may be given a state (``build``) or items."""
        key = self._key(module, name)
        return key is not None and key in (self.buildable if build else self.containers)
