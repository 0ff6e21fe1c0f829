"""Plans, the weight and amax reductions in traced code.

A plan is built afresh in each trace rather than cached on the module: the quantizers
are then functions of the recipe's fields, which Dynamo guards by value (an equal recipe
does not recompile), and the module is not mutated. Stateful schemes other than delayed
scaling (``delayed``) are refused, as is an amax reduction over a process group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.comptime import comptime

from ..nn.function import plan_for
from ..nn.recompute import checkpoint_region
from ..nn.weight_cache import WeightCache, quantize_weight
from ..quantizers.reduction import all_reduce_max
from ..runtime.state import AutocastFrame
from ..schemes import Plan, Scheme, scheme_for
from .delayed import traced_delayed_plan


@torch.compiler.substitute_in_graph(plan_for, skip_signature_check=True)
def _traced_plan_for(
    module: Any, frame: AutocastFrame, weight: torch.Tensor, sharding: Any = None
) -> Plan:
    if sharding is not None:  # a tensor-parallel layer's (its group reductions refuse)
        return sharding.plan(module, frame, weight)
    scheme = scheme_for(frame.recipe)
    if scheme.stateful and type(scheme).traced_quantizers is not Scheme.traced_quantizers:
        return traced_delayed_plan(module, frame)
    if type(scheme).plan is not Scheme.plan:  # another stateful scheme
        raise RuntimeError(
            f"fastcast: {type(frame.recipe).__name__} does not run under torch.compile "
            "(its per-module state is updated outside the graph); use "
            "Float8CurrentScaling, or run this model in eager"
        )
    return scheme.plan(frame, {}, weight.device)


@torch.compiler.substitute_in_graph(quantize_weight, skip_signature_check=True)
def _traced_weight_quantize(
    cache: WeightCache, weight: torch.Tensor, quantizer: Any, first: Any, columnwise: bool
) -> Any:
    # The micro-batch cache is an eager optimisation: a compiled graph quantizes the weight
    # on every call (fused with its neighbours), which gives what the cache would hold.
    if getattr(quantizer, "from_history", False) and hasattr(type(weight), "fc_quantized"):
        # FSDP2 gathered this weight quantized for DelayedScaling; eager GEMMs take it as
        # gathered, but its quantizer (live scaling state) does not enter a graph, so the
        # trace would quantize the dequantized weight again: other codes, other amaxes.
        comptime(_refuse_delayed_gathered)
    return quantizer.quantize(weight, rowwise=True, columnwise=columnwise)


def _refuse_delayed_gathered(ctx: Any) -> None:
    # Raised at trace time (comptime): it reaches the caller as it is (see delayed.py).
    raise RuntimeError(
        "fastcast: DelayedScaling with FSDP2's quantized all-gather "
        "(fc.convert(..., quantized_all_gather=True)) does not run under torch.compile: "
        "the gathered FP8 weight's delayed-scaling quantizer cannot enter a graph; use "
        "Float8CurrentScaling, quantized_all_gather=False, or run the model in eager"
    )


@torch.compiler.substitute_in_graph(all_reduce_max, skip_signature_check=True)
def _traced_all_reduce_max(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    # A graph would have to hold the process group (guarding on its identity) and issue a
    # collective inside every quantize: refused, clearly, until that is designed.
    raise RuntimeError(
        "fastcast: amax reduction over a process group (amax_reduction_group) does not run "
        "under torch.compile yet; compile without it, or run that part in eager"
    )


@torch.compiler.substitute_in_graph(checkpoint_region, skip_signature_check=True)
def _traced_checkpoint_region(active: bool) -> None:
    # Dynamo traces torch.utils.checkpoint regions as a higher-order op whose recomputation
    # is part of the compiled graph: nothing to record or replay here.
    return None
