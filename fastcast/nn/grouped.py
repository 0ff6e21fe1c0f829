"""Mixture-of-experts modules: ``fc.GroupedLinear`` and the conversion of transformers 5
experts (``fc.convert`` calls ``convert_experts``).

Both run the grouped GEMM of ``fastcast.gemm_grouped`` inside an enabled ``fc.autocast``
and the high-precision computation outside it (or with ``enabled=False``), bit for bit
what the unconverted module computes.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..gemm_grouped import GroupedScaling, group_ids, grouped_gemm, grouped_scaling
from ..recipe import Recipe
from ..runtime.state import AutocastFrame, get_stack
from .recompute import checkpoint_region, checkpointed_call

logger = logging.getLogger("fastcast")


class GroupedLinear(nn.Module):
    """``num_groups`` linear layers applied to sorted token groups: ``y[t] = x[t] @
    weight[e].T (+ bias[e])`` for the tokens ``t`` of group ``e``.

    ``weight`` is ``[num_groups, out_features, in_features]`` (the transformers 5 experts
    layout), ``bias`` ``[num_groups, out_features]``. ``forward(x, offs)``: ``x`` ``[T,
    in_features]`` sorted by group, ``offs`` int32 ``[num_groups]`` the cumulative ends of
    the groups, on ``x``'s device (``torch._grouped_mm``'s convention; a group may be
    empty). Inside ``fc.autocast`` the three GEMMs are quantized per the recipe, with
    per-group weight and activation scales; nothing is read back to the host, so the
    layer is CUDA-graph safe and compiles with ``fullgraph=True``. Outside, it runs
    ``torch._grouped_mm`` in the input's precision.
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for what, n in (
            ("num_groups", num_groups),
            ("in_features", in_features),
            ("out_features", out_features),
        ):
            if type(n) is not int or n <= 0:
                raise ValueError(f"fastcast.GroupedLinear: {what} must be an int > 0, got {n!r}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each group as ``nn.Linear`` initialises its weight and bias."""
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            for e in range(self.num_groups):
                nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def __getstate__(self) -> dict[str, Any]:
        return _without_kept(self.__dict__)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        frame = current_frame(self)
        if frame.enabled:
            out = grouped_gemm(x, self.weight, offs, kept_scaling(self, frame.recipe))
        else:
            out = torch._grouped_mm(x, self.weight.transpose(1, 2), offs=offs)
        if self.bias is not None:
            out = out + self.bias[group_ids(offs, x.shape[0])].to(out.dtype)
        return out


# Where a module keeps its grouped scaling (a runtime cache, left out of pickles).
_KEPT = "_fc_grouped_scaling"


def kept_scaling(module: nn.Module, recipe: Recipe) -> GroupedScaling:
    """``module``'s ``grouped_scaling`` of ``recipe``, kept while the recipe stays (as
    ``fc.Linear`` keeps its plan: its quantizers are built once); built afresh in traced
    code, which must not mutate the module."""
    if torch.compiler.is_compiling():
        return grouped_scaling(recipe)
    kept = module.__dict__.get(_KEPT)
    if kept is None or kept.recipe is not recipe:
        kept = module.__dict__[_KEPT] = grouped_scaling(recipe)
    return kept


def _without_kept(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != _KEPT}


def current_frame(module: nn.Module) -> AutocastFrame:
    """The autocast frame ``module`` runs under: the thread's, or, when activation
    checkpointing recomputes it, the one its original call ran under (``fc.Linear``'s
    rule, ``checkpointed_call``: the recomputation usually runs after ``fc.autocast`` has
    exited)."""
    frame = get_stack()[0]
    region = checkpoint_region(frame.active)
    return frame if region is None else checkpointed_call(module, frame, *region)[0]


# -- transformers 5 experts ---------------------------------------------------------------------
def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers 5 experts module: 3-D expert parameters
    (``gate_up_proj`` or ``up_proj``, and ``down_proj``) and the attributes
    ``@use_experts_implementation`` gives it (``has_gate``, ``is_transposed``, a config
    with ``_experts_implementation``)."""
    params = module._parameters
    up = params.get("gate_up_proj" if getattr(module, "has_gate", True) else "up_proj")
    down = params.get("down_proj")
    if up is None or down is None or up.dim() != 3 or down.dim() != 3:
        return False
    marks = ("has_gate", "has_bias", "is_transposed", "num_experts")
    config = module.__dict__.get("config")
    return all(hasattr(module, m) for m in marks) and hasattr(config, "_experts_implementation")


def _in_out(weight: torch.Tensor, transposed: bool) -> tuple[int, int]:
    """``(in_features, out_features)`` of a ``[E, N, K]`` (``[E, K, N]`` transposed) weight."""
    return (weight.shape[1], weight.shape[2]) if transposed else (weight.shape[2], weight.shape[1])


class _FastcastExperts:
    """Put in front of a transformers experts class by ``convert_experts``: inside an
    enabled ``fc.autocast`` the experts run fastcast's grouped GEMMs; outside, the class's
    own forward (its configured experts implementation), untouched."""

    _fc_name: str | None = None

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        frame = current_frame(self)
        if not frame.enabled or getattr(self, "_is_expert_parallel", False):
            # (Expert parallelism's sentinel routing stays with transformers' implementations.)
            return super().forward(hidden_states, top_k_index, top_k_weights)  # type: ignore[misc]
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, frame.recipe)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The derived class is made at run time: pickle (and deepcopy) rebuild it from the
        # transformers class it derives from.
        base = type(self).__mro__[2]
        return (_rebuild, (base,), _without_kept(self.__dict__))


def _rebuild(base: type) -> Any:
    return object.__new__(converted_class(base))


@functools.cache
def converted_class(base: type) -> type:
    """The fastcast subclass of the experts class ``base`` (one per class)."""
    return type(
        f"Fastcast{base.__name__}",
        (_FastcastExperts, base),
        {"__module__": __name__, "__qualname__": f"Fastcast{base.__name__}"},
    )


def experts_forward(
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    recipe: Recipe,
) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts forward with fastcast's grouped GEMMs: tokens
    sorted by expert, group ends counted on the device (no ``bincount`` or ``nonzero``,
    which read sizes back to the host)."""
    device = hidden_states.device
    top_k = top_k_index.shape[-1]
    tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    experts = module.num_experts
    expert_ids = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(expert_ids, stable=True)
    x = hidden_states[perm // top_k]
    weights = top_k_weights.reshape(-1)[perm]
    counts = torch.zeros(experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, sorted_ids.long(), torch.ones_like(sorted_ids, dtype=torch.int64))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    scaling = kept_scaling(module, recipe)

    def linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = weight.transpose(1, 2) if module.is_transposed else weight
        out = grouped_gemm(inp, w, offs, scaling)
        if bias is not None:
            out = out + bias[sorted_ids].to(out.dtype)
        return out

    if module.has_gate:
        up = linear(x, module.gate_up_proj, module.gate_up_proj_bias if module.has_bias else None)
        act = module._apply_gate(up)
    else:
        up = linear(x, module.up_proj, module.up_proj_bias if module.has_bias else None)
        act = module.act_fn(up)
    down = linear(act, module.down_proj, module.down_proj_bias if module.has_bias else None)
    if getattr(module, "has_post_expert_norm", False):
        down = module.post_expert_norm(down)
    weighted = down * weights.unsqueeze(-1).to(down.dtype)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0], device=device)
    out = weighted[inv].view(tokens, top_k, hidden).sum(dim=1)
    return out.to(hidden_states.dtype)


def convert_experts(
    module: nn.Module,
    module_filter_fn: Callable[[nn.Module, str], bool] | None,
    recipe: Recipe | None,
) -> int:
    """Convert every transformers experts module below ``module`` (``is_experts``) in
    place, keeping its parameters, names and state-dict keys; returns how many experts
    modules run on the grouped GEMM afterwards (converted now or before). Experts
    whose features are not multiples of the recipe's block are kept, as are those
    ``module_filter_fn`` refuses; a recipe the grouped GEMM cannot run converts none."""
    align = 16
    if recipe is not None:
        try:
            align = grouped_scaling(recipe).alignment
        except TypeError as exc:
            logger.info("fastcast.convert: experts kept in high precision: %s", exc)
            return 0
    converted, already, skipped = 0, 0, []
    for name, sub in module.named_modules():
        if isinstance(sub, _FastcastExperts):
            already += 1
            continue
        if not is_experts(sub):
            continue
        up = sub.gate_up_proj if sub.has_gate else sub.up_proj
        dims = (*_in_out(up, sub.is_transposed), *_in_out(sub.down_proj, sub.is_transposed))
        if any(d % align for d in dims):
            skipped.append(f"{name} (features {dims} not multiples of {align})")
            continue
        if module_filter_fn is not None and not module_filter_fn(sub, name):
            skipped.append(f"{name} (module_filter_fn returned False)")
            continue
        sub.__class__ = converted_class(type(sub))
        sub._fc_name = name
        converted += 1
    if converted or skipped:
        logger.info(
            "fastcast.convert: converted %d experts module(s) to fastcast's grouped GEMM; "
            "skipped %d%s",
            converted,
            len(skipped),
            (": " + ", ".join(skipped[:10])) if skipped else "",
        )
    return converted + already
