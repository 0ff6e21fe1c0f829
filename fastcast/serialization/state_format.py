"""What a stateful scheme gives the extra-state codec: a ``StateFormat`` per state kind.

The codec (``extra_state.py``) owns the container: the magic, the version, the header
length, the stateless kind, version 1's dict and pickled payloads. Everything a kind's
state means (its header fields, the values after the header, how they are validated and
loaded) belongs to the scheme that keeps that state, which registers a ``StateFormat``
for the type of its ``ModuleState`` values (``@register_state_format``). The codec finds
formats here, by the kind code a saved header holds or by the type of a module's state,
so a new stateful recipe saves its state without an edit to ``serialization/``.

Also here: the checks every format runs on loaded tensors before reading them
(``check_readable``, ``check_holds``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

MAGIC = 0xFCA570
VERSION = 2
HEADER = 16  # values; slots 0..3 are the codec's, 4..15 the kind's
STATELESS = 0  # the kind of a module that keeps no state: the header alone
UNKNOWN = -1  # a header field whose value is unknown (older format, other library)


class StateFormat:
    """How the state of one kind is saved in, and loaded from, the extra-state tensor.

    A format sees a module's whole state (``module_state``: key -> ``ModuleState``,
    ``schemes.base``), since one header holds the fields of every value. Loading returns
    a new state dict on the CPU holding copies, validated in full; it never changes a
    module (the module installs what it gets), so a refused load changes nothing. Every
    refusal is a ValueError naming ``owner`` (the module and state-dict entry).
    """

    kind: ClassVar[int]  # header slot 2; part of the file format, never reused
    name: ClassVar[str]  # what ``fc.read_extra_state`` and version 1 called it
    state_type: ClassVar[type]  # the type of this kind's ``ModuleState`` values
    # Version 1's dict held one entry per ``module_state`` key, by this name (a kind that
    # version 1 did not know has none).
    version_1_names: ClassVar[Mapping[Any, str]] = {}

    def encode(self, module_state: dict[Any, Any]) -> tuple[dict[int, float], list[torch.Tensor]]:
        """The header fields (slot -> value, slots 4..15; the others stay 0) and the
        float32 CPU tensors whose values follow the header, in order."""
        raise NotImplementedError

    def decode(self, head: list[int], values: torch.Tensor, owner: str) -> dict[Any, Any]:
        """The state a version-2 tensor holds: ``head`` its header (integers, slots 0..3
        already checked), ``values`` the float32 CPU values after it."""
        raise NotImplementedError

    def load(self, parts: dict[Any, Any], owner: str) -> dict[Any, Any]:
        """The state of version 1's dict: ``parts``, ``module_state`` key -> the entry
        saved under its ``version_1_names`` name (as loaded: not checked yet)."""
        raise ValueError(f"{owner}: version 1 held no {self.name} state")

    def from_foreign(self, state: Any, owner: str) -> dict[Any, Any] | None:
        """The state another library's unpickled extra state converts to, or None when it
        is not one this format reads (only called inside ``fc.allow_unsafe_extra_state``)."""
        return None

    def view(self, module_state: dict[Any, Any]) -> dict[str, Any]:
        """A readable view for ``fc.read_extra_state``: names -> plain values, copies."""
        raise NotImplementedError


_BY_KIND: dict[int, StateFormat] = {}
_BY_TYPE: dict[type, StateFormat] = {}


def register_state_format(cls: type[StateFormat]) -> type[StateFormat]:
    """Class decorator: ``cls`` saves and loads the state of its kind."""
    fmt = cls()
    if fmt.kind == STATELESS or not isinstance(fmt.kind, int) or fmt.kind < 0:
        raise ValueError(f"{cls.__name__}: kind {fmt.kind!r} is not a free kind code")
    other = _BY_KIND.get(fmt.kind)
    if other is not None and type(other) is not cls:
        raise ValueError(
            f"{cls.__name__}: extra-state kind {fmt.kind} is {type(other).__name__}'s already"
        )
    _BY_KIND[fmt.kind] = fmt
    _BY_TYPE[fmt.state_type] = fmt
    return cls


def format_of_kind(kind: int) -> StateFormat | None:
    """The format of a saved header's kind code (None: not one this fastcast knows)."""
    return _BY_KIND.get(kind)


def format_of_name(name: Any) -> StateFormat | None:
    """The format that version 1 (and ``fc.read_extra_state``) calls ``name``."""
    return next((f for f in _BY_KIND.values() if f.name == name), None)


def format_of_state(module_state: dict[Any, Any]) -> StateFormat | None:
    """The one format that saves every value of ``module_state`` (None: there is none)."""
    found = {_BY_TYPE.get(type(value)) for value in module_state.values()}
    return found.pop() if len(found) == 1 else None


def formats() -> list[StateFormat]:
    """Every registered format, in kind order."""
    return [_BY_KIND[kind] for kind in sorted(_BY_KIND)]


def check_readable(t: torch.Tensor, owner: str, what: str) -> None:
    """ValueError naming ``owner`` unless ``t`` is a dense tensor with values to read (on
    any device but meta): a meta, sparse or nested tensor would otherwise fail deep in
    torch with a NotImplementedError or RuntimeError that names no module."""
    if t.is_meta:
        raise ValueError(
            f"{owner}: {what} is a tensor on the meta device, which holds no values (a "
            "state dict of a model not yet materialised?); load a state dict with data"
        )
    if t.is_nested or t.layout != torch.strided:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise ValueError(
            f"{owner}: {what} is a {layout} tensor; fastcast's state is a dense 1-D float32 "
            "tensor (load the state dict as the model saved it, or a dense copy)"
        )


def check_holds(tensor: Any, owner: str, what: str) -> None:
    """Refuse a tensor that claims more elements than its storage holds (a stride-0 view
    of a few bytes in a file can claim millions, which any copy would then allocate)."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        return
    held = tensor.untyped_storage().nbytes() // tensor.element_size() - tensor.storage_offset()
    if tensor.numel() > max(held, 0):
        raise ValueError(
            f"{owner}: {what} claims {tensor.numel()} values (shape {tuple(tensor.shape)}) but "
            f"its storage holds {max(held, 0)}; refusing it before copying"
        )
