"""Tracing ranges: NVTX (nsys) and ``torch.profiler`` scopes, free when off.

A handful of functions are marked with ``@annotate(name)``: autocast enter and exit,
Linear forward and backward, the quantizers, the scaled GEMM and the delayed-scaling
amax update. ``annotate`` returns the function itself, so while tracing is off nothing
runs per call: there is no flag to test.

``enable()`` (or ``FASTCAST_NVTX=1`` in the environment at import) rebinds every marked
function, wherever fastcast's own modules and classes hold it, to a wrapper that runs it
inside an NVTX range of the domain ``fastcast`` *and* a ``torch.profiler``
``record_function`` scope of the same name; ``disable()`` puts the originals back. Call
it before the modules run: a reference taken earlier outside fastcast (``from
fastcast.gemm import scaled_mm`` in user code) keeps the original.

Linear ranges name their module: ``fastcast.Linear.forward[blocks.0.fc1]`` and the same
for its backward, with the qualified name ``fc.convert`` recorded (``_fc_name``).
Under ``torch.compile`` tracing the wrappers call straight through (the compiled graph
has no Python ranges to keep).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

DOMAIN = "fastcast"
# Set when FASTCAST_NVTX=1 at import: fastcast/__init__.py then calls enable().
ENV_ENABLED = os.environ.get("FASTCAST_NVTX", "0").strip() not in ("", "0", "false", "False")

# The marked functions, by id: original -> (name, instance attribute naming the range).
# Filled as the modules defining them are imported; an entry never changes.
_MARKED: dict[int, tuple[Callable[..., Any], str, str | None]] = {}
# The one switch: whether the marked functions are wrapped now (read by annotate, so
# that a module imported after enable() is traced as well).
_switch = {"on": False}


def annotate(name: str, instance_name: str | None = None) -> Callable[[F], F]:
    """Decorator: mark ``fn`` as the range ``name``; returns ``fn`` itself while off.

    ``instance_name``: an attribute of the first argument (``self``, or an autograd
    ``ctx``) whose value, when set, qualifies the range: ``name[value]``. The wrapper of a
    call whose result came out of an autograd Function stores that value on the
    Function's node too, so its backward (marked with the same attribute) is named alike.
    """

    def mark(fn: F) -> F:
        _MARKED[id(fn)] = (fn, name, instance_name)
        return _traced(fn, name, instance_name) if _switch["on"] else fn  # type: ignore[return-value]

    return mark


def is_enabled() -> bool:
    """Whether the marked functions are wrapped in ranges now."""
    return _switch["on"]


def enable() -> None:
    """Wrap every marked function in an NVTX range and a ``record_function`` scope."""
    if _switch["on"]:
        return
    _switch["on"] = True
    wrappers: dict[int, Callable[..., Any]] = {}  # one wrapper per function, shared

    def wrap_if_marked(fn: Any) -> Any:
        entry = _MARKED.get(id(fn))
        if entry is None or entry[0] is not fn:
            return None
        if id(fn) not in wrappers:
            wrappers[id(fn)] = _traced(*entry)
        return wrappers[id(fn)]

    _rebind(wrap_if_marked)


def disable() -> None:
    """Put the original functions back: no range costs anything any more."""
    if not _switch["on"]:
        return
    _switch["on"] = False
    _rebind(lambda fn: getattr(fn, "_fc_original", None))


def marked_names() -> list[str]:
    """The range names (without module qualifiers), sorted: what a trace can contain."""
    return sorted({name for _, name, _ in _MARKED.values()})


# --------------------------------------------------------------------------- rebinding


def _rebind(replacement: Callable[[Any], Any]) -> None:
    """Replace, in fastcast's modules and their classes, each function for which
    ``replacement`` returns something other than None."""
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "fastcast" or mod_name.startswith("fastcast.")):
            continue
        for attr, value in list(vars(module).items()):
            new = replacement(value) if callable(value) else None
            if new is not None:
                setattr(module, attr, new)
            elif isinstance(value, type) and value.__module__ == mod_name:
                _rebind_class(value, replacement)


def _rebind_class(cls: type, replacement: Callable[[Any], Any]) -> None:
    for attr, value in list(vars(cls).items()):
        wrapper = type(value) if isinstance(value, (staticmethod, classmethod)) else None
        new = replacement(value.__func__ if wrapper else value)
        if new is not None:
            setattr(cls, attr, wrapper(new) if wrapper else new)


# --------------------------------------------------------------------------- the wrapper


def _traced(fn: F, name: str, instance_name: str | None) -> F:
    import torch  # noqa: PLC0415

    # The closure holds only functions and strings: Dynamo, tracing a compiled caller,
    # builds a variable for every cell, and cannot for NVTX's objects.
    compiling = torch.compiler.is_compiling
    profiling = torch._C._autograd._profiler_enabled  # whether a torch.profiler records
    record_function = torch.autograd.profiler.record_function
    push, pop = _nvtx_push, _nvtx_pop

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if compiling():
            return fn(*args, **kwargs)
        label = name
        qualifier = getattr(args[0], instance_name, None) if instance_name and args else None
        if qualifier:
            label = f"{name}[{qualifier}]"
        push(label)
        try:
            if profiling():  # a record_function costs ~8 µs even with no profiler to see it
                with record_function(label):
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
        finally:
            pop()
        if qualifier:
            _name_function_node(out, instance_name, qualifier)
        return out

    traced._fc_original = fn  # type: ignore[attr-defined]
    return traced  # type: ignore[return-value]


# NVTX: the domain (key "") and the attributes of each range name, made once each
# (immutable facts, process-wide).
_NVTX: dict[str, Any] = {}


def _nvtx_push(label: str) -> None:
    attributes = _NVTX.get(label)
    if attributes is None:
        domain = _nvtx_domain()
        attributes = _NVTX[label] = domain.get_event_attributes(message=label)
    _NVTX[""].push_range(attributes)


def _nvtx_pop() -> None:
    _NVTX[""].pop_range()


def _nvtx_domain() -> Any:
    domain = _NVTX.get("")
    if domain is None:
        import nvtx  # noqa: PLC0415 - only imported when tracing

        domain = _NVTX[""] = nvtx.get_domain(DOMAIN)
    return domain


def _name_function_node(out: Any, attr: str, value: str) -> None:
    """Store ``value`` on the autograd Function node that produced ``out`` (a few view
    nodes deep at most: padded inputs slice the Function's output)."""
    node = getattr(out, "grad_fn", None)
    for _ in range(4):
        if node is None:
            return
        if hasattr(node, "_forward_cls"):  # a custom autograd Function's node (its ctx)
            setattr(node, attr, value)
            return
        following = node.next_functions
        node = following[0][0] if following else None
