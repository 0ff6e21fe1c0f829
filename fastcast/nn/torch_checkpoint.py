"""The one module that reads torch internals: where ``torch.utils.checkpoint`` is.

torch offers a layer no public way to ask "am I inside an activation-checkpointed
region, and is this its recomputation?". This adapter answers it from what torch's
checkpoint does today (stable since torch 2.1), and ``tests/nn/test_torch_checkpoint.py``
pins each fact it relies on, so a torch that changes them fails that test by name:

- ``use_reentrant=False``: the region's saved-tensor hooks are on top of autograd's hook
  stack, in the original forward (``_checkpoint_hook``'s pack hook, whose closure holds
  the region's frame object) and in the recomputation (``_recomputation_hook``'s, holding
  a weak reference to the same frame);
- ``use_reentrant=True``: the recomputation runs inside the region's own autograd node
  (``CheckpointFunctionBackward``, torch's current autograd node then); the original
  forward runs under ``no_grad`` in ``CheckpointFunction.forward``, whose ``ctx`` is that
  same node, found on the Python stack (only for calls that quantize or record).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointFunction

top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
current_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward
_current_node = torch._C._current_autograd_node
_REENTRANT_FORWARD = CheckpointFunction.forward.__code__
_REENTRANT_NODE = "CheckpointFunctionBackward"
# How far up the Python stack a reentrant region's original forward is looked for.
_MAX_DEPTH = 64


def region(active: bool) -> tuple[Any, bool] | None:
    """``(region, recomputing)`` when the caller runs inside a checkpointed region, else
    None. ``region`` is an object of torch's, one per region, alive as long as the region
    can be recomputed. ``active``: whether the caller quantizes or records (only then is
    a reentrant region's original forward looked for)."""
    hooks = top_saved_tensors_hooks(False)
    if hooks is not None:
        return _non_reentrant(hooks[0])
    if not torch.is_grad_enabled():
        # Under inference mode no graph is recorded, so no region entered there can be
        # recomputed: the Python stack is not walked (inference under fc.autocast).
        if not active or torch.is_inference_mode_enabled():
            return None
        found = _reentrant_forward()
        return None if found is None else (found, False)
    if current_graph_task_id() != -1:  # a forward inside a backward: maybe a recomputation
        node = _current_node()
        if node is not None and type(node).__name__ == _REENTRANT_NODE:
            return node, True
    return None


def _non_reentrant(pack_hook: Callable[..., Any]) -> tuple[Any, bool] | None:
    name = getattr(pack_hook, "__qualname__", "")
    if name.startswith("_checkpoint_hook."):
        found = _closure_var(pack_hook, "frame")
        return None if found is None else (found, False)
    if name.startswith("_recomputation_hook."):
        ref = _closure_var(pack_hook, "target_frame_ref")
        found = ref() if callable(ref) else None
        return None if found is None else (found, True)
    return None


def _closure_var(fn: Callable[..., Any], name: str) -> Any:
    fn = getattr(fn, "__wrapped__", fn)  # torch wraps one hook in a dynamo-disable shim
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars or fn.__closure__ is None:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _reentrant_forward() -> Any:
    frame = sys._getframe(3)  # region <- checkpoint_region <- the layer's forward
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _REENTRANT_FORWARD:
            return frame.f_locals.get("ctx")
        frame = frame.f_back
    return None
