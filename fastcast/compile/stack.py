"""The autocast stack as Dynamo sees it: ``fastcast.runtime.state``'s traced accessors.

Eager autocast keeps its stack in a ``ContextVar``, whose methods Dynamo cannot trace.
The three accessors (``state.get_stack``, ``set_stack``, ``reset_stack``) get the
polyfills ``state.traced_*``, which read the context variable through a property Dynamo
guards on (see ``state._CompiledView``): compiled code sees the autocast state of the
context that calls it, per thread and per asyncio task, as eager code does, and a call
from a context whose state differs from the one a graph was traced under fails its
guards (another graph is traced, or a cached one that matches runs). An autocast entered
inside a compiled function is traced: its frame, and so its recipe, become guarded
constants of the graph (it does not warn when no layer ran in it). Nothing is rebound,
and eager code pays nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch._dynamo import assume_constant_result
from torch._dynamo.symbolic_convert import InstructionTranslator

from ..runtime import state as _state

_autocast_module = importlib.import_module("fastcast.autocast")  # the module, not the class

_substitute = torch.compiler.substitute_in_graph
_substitute(_state.get_stack, skip_signature_check=True)(_state.traced_get_stack)
_substitute(_state.set_stack, skip_signature_check=True)(_state.traced_set_stack)
_substitute(_state.reset_stack, skip_signature_check=True)(_state.traced_reset_stack)


@_substitute(_autocast_module._ran_nothing, skip_signature_check=True)
def _traced_ran_nothing(below: Any) -> None:
    # A graph does not warn (a warning is not an operation Dynamo can put in a graph); the
    # eager autocast around a compiled model still does.
    return None


@_substitute(_state.mark_ran, skip_signature_check=True)
def _traced_mark_ran(frame: Any) -> None:
    # The store is a side effect Dynamo replays after the graph, on the frame of the
    # calling context. Inside a higher-order op's body (activation checkpointing) Dynamo
    # refuses outside mutations, so there it is skipped: an eager autocast whose only
    # layers ran in a compiled checkpointed region may warn that none ran.
    if not _in_subgraph():
        frame.ran = True


@assume_constant_result
def _in_subgraph() -> bool:
    """Runs for real while tracing: whether the layer is traced inside a higher-order
    op's body (a fact of where the code is traced, the same on every call)."""
    tx = InstructionTranslator.current_tx()
    return tx.output.current_tracer.parent is not None
