"""Tracing ranges: NVTX (nsys) and ``torch.profiler`` scopes, free when off.

``enable()`` (or ``FASTCAST_NVTX=1`` at import) attaches one observer to the state
manager's observer points (``fastcast.runtime.observers``); ``disable()`` detaches it.
Nothing is replaced: each point costs one test of an empty list while no observer is
attached. Ranges, in the domain ``fastcast``: ``RANGES`` below. The ``fc.Linear`` ranges
name their module (``fastcast.Linear.forward[blocks.0.fc1]``, the qualified name
``fc.convert`` recorded): the forward's from torch's public module hooks, registered only
while tracing is on, the backward's from ``LinearFunction.backward``'s observer point,
named in its autograd node's public ``metadata``. Under ``torch.compile`` tracing no range
is opened.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from .nn.linear import Linear
from .runtime import observers
from .runtime.observers import BACKWARD_RANGE

DOMAIN = "fastcast"
# Set when FASTCAST_NVTX=1 at import: fastcast/__init__.py then calls enable().
ENV_ENABLED = os.environ.get("FASTCAST_NVTX", "0").strip() not in ("", "0", "false", "False")

# Every range a trace can hold (the observer points that open them: autocast.py, the
# quantizers, gemm.py, schemes/delayed/owners.py; the Linear ranges come from hooks).
RANGES = (
    "fastcast.autocast.enter",
    "fastcast.autocast.exit",
    "fastcast.Linear.forward",
    "fastcast.Linear.backward",
    "fastcast.quantize.tensorwise",
    "fastcast.quantize.rowwise",
    "fastcast.quantize.block",
    "fastcast.quantize.mxfp8",
    "fastcast.quantize.nvfp4",
    "fastcast.scaled_mm",
    "fastcast.amax_update",
)


def is_enabled() -> bool:
    """Whether the ranges are on."""
    return _attached() is not None


def enable() -> None:
    """Open an NVTX range and a ``record_function`` scope at every observer point."""
    if _attached() is None:
        ranges = Ranges()
        observers.attach(ranges)
        ranges.hook_modules()


def disable() -> None:
    """Detach the ranges: no point costs more than its test any more."""
    ranges = _attached()
    if ranges is not None:
        observers.detach(ranges)
        ranges.unhook_modules()


def marked_names() -> list[str]:
    """The range names, sorted: what a trace can contain."""
    return sorted(RANGES)


def _attached() -> Ranges | None:
    for observer in observers.attached:
        if type(observer) is Ranges:
            return observer
    return None


class Ranges(observers.Observer):
    """The observer ``enable()`` attaches: NVTX + ``record_function`` per range."""

    def __init__(self) -> None:
        self.nvtx: dict[str, Any] = {}  # "": the domain; label -> its event attributes
        self.handles: list[Any] = []  # the module hooks, removed by unhook_modules
        self.open = threading.local()  # per thread: the tokens of open Linear forwards

    # -- the observer points -------------------------------------------------------------
    def range_begin(self, name: str) -> Any:
        if torch.compiler.is_compiling():
            return None
        self._push(name)
        if not torch._C._autograd._profiler_enabled():
            return True  # a record_function costs ~8 µs even with no profiler to see it
        scope = torch.autograd.profiler.record_function(name)
        scope.__enter__()
        return scope

    def range_end(self, token: Any) -> None:
        if token is None:
            return
        if token is not True:
            token.__exit__(None, None, None)
        self._pop()

    # -- fc.Linear: torch's module hooks, and the name of the backward's range ----------
    def hook_modules(self) -> None:
        hooks = torch.nn.modules.module
        self.handles = [
            hooks.register_module_forward_pre_hook(self._forward_begin),
            hooks.register_module_forward_hook(self._forward_end, always_call=True),
        ]

    def unhook_modules(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _forward_begin(self, module: Any, args: Any) -> None:
        if isinstance(module, Linear):
            stack = self.open.__dict__.setdefault("stack", [])
            stack.append(self.range_begin(_label("fastcast.Linear.forward", module)))

    def _forward_end(self, module: Any, args: Any, out: Any) -> None:
        if not isinstance(module, Linear):
            return
        stack = self.open.__dict__.get("stack")
        if stack:
            self.range_end(stack.pop())
        if not torch.compiler.is_compiling():
            # The backward's range opens at LinearFunction.backward's observer point, under
            # the name left in its node's public metadata (hooks on the node would make the
            # engine call Python around it: ~20% of a small layer's step, measured).
            node = _function_node(out)
            if node is not None:
                node.metadata[BACKWARD_RANGE] = _label("fastcast.Linear.backward", module)

    # -- NVTX ----------------------------------------------------------------------------
    def _push(self, label: str) -> None:
        attributes = self.nvtx.get(label)
        if attributes is None:
            attributes = self.nvtx[label] = self._domain().get_event_attributes(message=label)
        self.nvtx[""].push_range(attributes)

    def _pop(self) -> None:
        self.nvtx[""].pop_range()

    def _domain(self) -> Any:
        domain = self.nvtx.get("")
        if domain is None:
            import nvtx  # noqa: PLC0415 - a third-party package, only needed when tracing

            domain = self.nvtx[""] = nvtx.get_domain(DOMAIN)
        return domain


def _label(name: str, module: Any) -> str:
    qualifier = getattr(module, "_fc_name", None)
    return f"{name}[{qualifier}]" if qualifier else name


def _function_node(out: Any) -> Any:
    """The custom autograd Function node that produced ``out`` (a few view nodes deep at
    most: padded inputs slice the Function's output), or None."""
    node = getattr(out, "grad_fn", None)
    for _ in range(4):
        if node is None:
            return None
        if hasattr(node, "_forward_cls"):
            return node
        following = node.next_functions
        node = following[0][0] if following else None
    return None
