"""The autocast stack as Dynamo sees it.

Eager autocast keeps its stack in a ``ContextVar``, which Dynamo cannot trace. Instead of
testing ``torch.compiler.is_compiling()`` on the hot path, the two stack accessors
(``state.get_stack``, ``state.set_stack``) get polyfills: traced code reads and writes
``compiled.stack``, a per-thread attribute that Dynamo guards on. An autocast entered
inside a compiled function is therefore traced (its frame, and so its recipe, become
guarded constants of the graph).

An autocast entered in eager around a compiled model must be visible to the guards too:
from the first trace that reads the stack on, eager autocast mirrors its stack into
``compiled.stack`` (one more attribute store per enter and exit, in processes that
compile fastcast code only; eager-only processes never pay it). Compiled code sees the
stack of its thread: under compile the state is per thread, not per asyncio task, and a
thread that was inside an eager autocast when mirroring started is seen by compiled code
only from its next enter or exit.
"""

from __future__ import annotations

import importlib
import threading

import torch
from torch._dynamo import assume_constant_result

from .. import state as _state
from ..state import BOTTOM, Stack

_autocast_module = importlib.import_module("fastcast.autocast")  # the module, not the class


class _CompiledStack(threading.local):
    """Per thread: the autocast stack compiled code sees (guarded by Dynamo)."""

    def __init__(self) -> None:
        # Set per thread (not a class default): Dynamo guards on the instance dict.
        self.stack: Stack = BOTTOM


compiled = _CompiledStack()


def _set_both(stack: Stack) -> None:
    """``set_stack`` once mirroring is on: the context variable, then the mirror."""
    _state.set_stack(stack)
    compiled.stack = stack


@assume_constant_result
def _sync_from_eager() -> bool:
    """Runs for real while tracing: from the first trace on, eager autocast mirrors its
    stack (compiled code traced without an autocast must see one entered later)."""
    if _autocast_module.set_stack is not _set_both:
        _autocast_module.set_stack = _set_both
        compiled.stack = _state.get_stack()
    return True


@torch.compiler.substitute_in_graph(_state.get_stack, skip_signature_check=True)
def _traced_get_stack() -> Stack:
    _sync_from_eager()
    return compiled.stack


def _traced_set_stack(stack: Stack) -> None:
    compiled.stack = stack


torch.compiler.substitute_in_graph(_state.set_stack, skip_signature_check=True)(_traced_set_stack)
torch.compiler.substitute_in_graph(_set_both, skip_signature_check=True)(_traced_set_stack)
