"""Describing a whole payload: streams of pickles, zip archives, nested payloads.

``_Model`` spends one budget across every pickle of a payload (bytes read, opcodes,
globals) and records in the ``PickleReport`` what they import and call, what a
restricted unpickler would refuse, and why what they would run is unknown. Payloads
handed to a loader that unpickles bytes (``torch.storage._load_from_bytes``,
``pickle.loads``) are described in turn, as are every ``*.pkl`` entry of a
``torch.save`` archive and each pickle of a legacy ``torch.save`` stream.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from typing import TYPE_CHECKING, Any

from .pickle_machine import _Machine
from .pickle_symbols import (
    _KEPT_NOTES,
    _MAX_ARCHIVE,
    _MAX_GLOBALS,
    _MAX_NESTING,
    _MAX_PICKLE_BYTES,
    _MAX_PICKLES_PER_STREAM,
    _MAX_ZIP_ENTRIES,
    _NOTHING,
    _SHOWN_CHARS,
    ZIP_MAGIC,
    _Bytes,
    _clip,
    _Global,
    _Malformed,
    _old_name,
    _Result,
    _TooLarge,
    _Unknown,
)

if TYPE_CHECKING:
    from .pickle_model import AllowList, PickleReport


# The loaders that unpickle bytes given to them: what they are given is described too.
_NESTED_LOADERS = frozenset({"torch.storage._load_from_bytes", "pickle.loads", "_pickle.loads"})


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
