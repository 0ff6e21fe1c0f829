"""Tracing ranges: NVTX (nsys) and ``torch.profiler`` scopes, free when off.

A handful of functions are marked with ``@annotate(name)``: autocast enter and exit,
Linear forward and backward, the quantizers, the scaled GEMM and the delayed-scaling
amax update. ``annotate`` returns the function itself, so while tracing is off nothing
runs per call: there is no flag to test.

``enable()`` (or ``FASTCAST_NVTX=1`` in the environment at import) replaces each marked
function where it is defined (its class's attribute, or its module's, found from its
qualified name; nothing else is touched) by a wrapper that runs it inside an NVTX range
of the domain ``fastcast`` *and* a ``torch.profiler`` ``record_function`` scope of the
same name; ``disable()`` puts the originals back. The switch itself is the state
manager's (``state.ranges_on``). Call it before the modules run: a reference taken
earlier (``from fastcast.gemm import scaled_mm`` in user code) keeps the original.

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

from .runtime import state as _state

F = TypeVar("F", bound=Callable[..., Any])

DOMAIN = "fastcast"
# Set when FASTCAST_NVTX=1 at import: fastcast/__init__.py then calls enable().
ENV_ENABLED = os.environ.get("FASTCAST_NVTX", "0").strip() not in ("", "0", "false", "False")

# The marked functions, by id: original -> (name, instance attribute naming the range).
# A registry filled as the modules defining them are imported; an entry never changes.
_MARKED: dict[int, tuple[Callable[..., Any], str, str | None]] = {}


def annotate(name: str, instance_name: str | None = None) -> Callable[[F], F]:
    """Decorator: mark ``fn`` as the range ``name``; returns ``fn`` itself while off.

    ``instance_name``: an attribute of the first argument (``self``, or an autograd
    ``ctx``) whose value, when set, qualifies the range: ``name[value]``. The wrapper of a
    call whose result came out of an autograd Function stores that value on the
    Function's node too, so its backward (marked with the same attribute) is named alike.
    """

    def mark(fn: F) -> F:
        _MARKED[id(fn)] = (fn, name, instance_name)
        return _traced(fn, name, instance_name) if _state.ranges_on else fn  # type: ignore[return-value]

    return mark


def is_enabled() -> bool:
    """Whether the marked functions are wrapped in ranges now."""
    return _state.ranges_on


def enable() -> None:
    """Wrap every marked function in an NVTX range and a ``record_function`` scope."""
    if not _state.ranges_on:
        _state.ranges_on = True
        _rebind(lambda fn, name, instance_name: _traced(fn, name, instance_name))


def disable() -> None:
    """Put the original functions back: no range costs anything any more."""
    if _state.ranges_on:
        _state.ranges_on = False
        _rebind(lambda fn, name, instance_name: fn)


def marked_names() -> list[str]:
    """The range names (without module qualifiers), sorted: what a trace can contain."""
    return sorted({name for _, name, _ in _MARKED.values()})


# --------------------------------------------------------------------------- rebinding


def _rebind(make: Callable[..., Any]) -> None:
    """Set each marked function's definition site to ``make(fn, name, instance_name)``."""
    for fn, name, instance_name in _MARKED.values():
        site = _definition_site(fn)
        if site is None:
            continue
        owner, attr = site
        held = vars(owner).get(attr)
        wrapper = type(held) if isinstance(held, (staticmethod, classmethod)) else None
        func = held.__func__ if wrapper else held
        if func is not fn and getattr(func, "_fc_original", None) is not fn:
            continue  # the site holds something else now (a test's stand-in, say)
        new = make(fn, name, instance_name)
        setattr(owner, attr, wrapper(new) if wrapper else new)


def _definition_site(fn: Any) -> tuple[Any, str] | None:
    """``(class or module, attribute)`` where ``fn`` is defined, from its qualified name;
    None for a function defined inside another (nothing holds it by name)."""
    *path, attr = fn.__qualname__.split(".")
    owner = sys.modules.get(fn.__module__)
    for part in path:
        owner = None if part == "<locals>" else getattr(owner, part, None)
        if owner is None:
            return None
    return owner, attr


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
