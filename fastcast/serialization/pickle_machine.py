"""One pickle run over symbols: the stack, marks and memo an unpickler holds, and what
each opcode does to them.

``_Machine.run`` models one pickle from its first opcode to ``STOP``; the opcode table
(``_OPS``, built from pickletools' list so that an opcode added to pickle later is read
and reported, not misread) pairs each opcode byte with its argument reader
(``pickle_args.py``) and its handler. What globals, calls and changes mean for the
report is the payload model's (``pickle_payloads._Model``), which the machine reports to.
"""

from __future__ import annotations

import pickle
import pickletools
from typing import TYPE_CHECKING, Any

from .pickle_args import _OPCODE_READERS, _READERS
from .pickle_symbols import (
    _DATA,
    _MAX_MEMO,
    _MAX_OPCODES,
    _NOTHING,
    _Malformed,
    _TooLarge,
    _Unknown,
)

if TYPE_CHECKING:
    from .pickle_payloads import _Model


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
