"""Reading pickles without trusting them: the description of a payload, and allow-lists.

``describe_pickle`` says what a payload would import and call, found by running a model
of the pickle machine over its opcodes: the stack, marks and memo hold symbols instead of
objects, and nothing is imported or called. The payload may be a bare pickle, a
``torch.save`` zip archive (every ``*.pkl`` entry is read) or a legacy ``torch.save``
stream (several pickles in a row), and the bytes handed to
``torch.storage._load_from_bytes`` (how a tensor pickles outside ``torch.save``) are
described in turn. Every opcode argument is parsed as CPython's ``_pickle`` parses it
(``INT`` in base 0, ``FLOAT`` without surrounding spaces, ...), and a pickle read from a
file (``torch.load``) is followed frame by frame as that unpickler reads it, so the model
stops where ``pickle`` stops and nowhere else. Describing is bounded: past the caps of
``pickle_symbols.py`` the answer is "too large to describe", and where the model cannot
know what would run (a global whose name is computed at load time, say) the answer says
"unknown" rather than listing only what it could see.

This module is the front: the payload's bytes, the report (``PickleReport``) and
``AllowList``. The model behind it: ``pickle_payloads.py`` (a payload's pickles,
archives and nested payloads, and what they mean for the report), ``pickle_machine.py``
(one pickle's stack and opcodes), ``pickle_args.py`` (opcode arguments, as ``_pickle``
reads them) and ``pickle_symbols.py`` (the symbols and the caps).

Given an ``AllowList`` (what a restricted unpickler would give for each global), the
description also lists what that unpickler refuses. Loading is ``unpickling.py``; none
of these modules knows any library's format (``transformer_engine.py`` adds
TransformerEngine's).
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .pickle_payloads import _Model
from .pickle_symbols import (
    _MAX_PAYLOAD,
    _SHOWN_GLOBALS,
    _SHOWN_REASONS,
    ZIP_MAGIC,
    _old_name,
    _TooLarge,
)

_EXTRA_STATE_REFUSAL = "not allowed even inside fc.allow_unsafe_extra_state()"


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

    __slots__ = (
        "size",
        "kind",
        "imports",
        "refused",
        "refusal",
        "unknown",
        "failures",
        "too_large",
        "nested",
    )

    def __init__(self, size: int, kind: str, refusal: str = "") -> None:
        self.size = size
        self.kind = kind
        self.refusal = refusal or _EXTRA_STATE_REFUSAL  # how refused globals are introduced
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
            text += f"; {self.refusal}: {refused}"
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
    report = PickleReport(
        size, "torch.save archive" if zipped else "pickle", allowed.refusal if allowed else ""
    )
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


# -- what a restricted unpickler allows ----------------------------------------------------------
class AllowList:
    """What a restricted unpickler gives for each global it allows, and which of what they
    make the pickle may change: ``buildable`` results may be given a state (``BUILD``),
    ``containers`` may be given items (``SETITEMS``, ``APPENDS``...). ``what`` says in
    words what is allowed, for refusals. Python 2 spellings of a global are looked up as
    pickle maps them (whatever the protocol: both spellings give only something allowed).
    """

    __slots__ = ("globals", "buildable", "containers", "what", "refusal")

    def __init__(
        self,
        globals_: Mapping[tuple[str, str], Any],
        what: str,
        buildable: Iterable[tuple[str, str]] = (),
        containers: Iterable[tuple[str, str]] = (),
        refusal: str = "",
    ) -> None:
        self.globals = dict(globals_)
        self.buildable = frozenset(buildable)
        self.containers = frozenset(containers)
        self.what = what
        # How a description introduces the globals this list refuses (by default, as
        # an extra state's: nothing lets fastcast unpickle them).
        self.refusal = refusal or _EXTRA_STATE_REFUSAL

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
            self.refusal,
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
