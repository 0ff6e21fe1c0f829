"""Quantized FSDP2 all-gather: ``fc.Linear`` weights gathered as FP8 codes and a scale.

``fc.convert(model, recipe=fc.Float8CurrentScaling(), quantized_all_gather=True)`` wraps
each ``fc.Linear`` weight in an ``FSDPFloat8Weight`` (the parameter stays a leaf with the
same values, dtype and state-dict key). ``fully_shard`` then shards it as it shards any
parameter, and uses the two extension hooks FSDP2 looks for on a parameter's local shard:

- ``fsdp_pre_all_gather``: the shard's FP8 codes (as bytes) are what goes on the wire,
  with the per-tensor scale as metadata. The scale comes from the amax of the *whole*
  weight: the shard's amax max-reduced over the FSDP group, so every rank casts its
  shard exactly as one process casts the whole weight (same scale, same codes).
- ``fsdp_post_all_gather``: the gathered codes and the scale become the unsharded
  parameter, a ``GatheredFloat8Weight``. Under an ``fc.autocast`` whose weight quantizer
  is the one the weight was gathered for, the forward GEMM takes that FP8 weight as it is
  (and its transposed codes for the input gradient), with no second cast.

The gathered format is chosen once, at ``fc.convert`` time: FSDP2 allocates each
parameter's all-gather buffers at the first gather and keeps their sizes and dtypes, so
the gather cannot switch between FP8 (autocast steps) and high precision (evaluation
outside autocast). Backward's re-gather (``reshard_after_forward=True``) runs outside the
autocast block anyway. Anything else that reads the gathered weight (``F.linear`` outside
autocast, an autocast with another recipe) sees its dequantized value
``codes * scale_inv``: the weight rounded to FP8, a relative error up to 2**-4 per
element (E4M3), not the high-precision weight. Evaluate outside autocast with
``quantized_all_gather=False`` if that matters, or gather the full weights first.

One all-reduce per weight and step, by default (the scale is kept while the weight is
unchanged, so backward's re-gather reuses it). ``precompute_float8_scales(model)`` after
the optimizer step does all of a model's weights in one all-reduce instead (torchao's
``precompute_float8_dynamic_scale_for_fsdp``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from ..formats import ELEMENT_MAX, FP8_DTYPES
from ..quantizers.base import transposed_codes
from ..quantizers.tensorwise import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    quantize_with_scale,
)
from ..recipe import DelayedScaling, Float8CurrentScaling, Recipe
from ..reference.cast import scale_from_amax, tensor_amax
from ..runtime.state import get_stack, optimizer_steps
from ..schemes import scheme_for
from ..schemes.delayed.state import FORWARD
from ..tensor import WHOLE, Float8Tensor
from .amax import all_reduce_max

__all__ = [
    "FSDPFloat8Weight",
    "GatheredFloat8Weight",
    "enable_quantized_all_gather",
    "precompute_float8_scales",
]

aten = torch.ops.aten

# Ops whose result is still the (sharded, high-precision) weight: FSDP2 shards, pads and
# copies the parameter with these, and each result must keep the hooks.
_KEEP_WRAPPED = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.chunk.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten.zero_.default,
}


# Views FSDP2 makes of the gathered parameter (they keep the FP8 codes).
_VIEWS = (aten.as_strided.default, aten.view.default, aten.detach.default, aten.alias.default)


def weight_format(recipe: Recipe) -> str:
    """The FP8 format of ``recipe``'s weights (a per-tensor recipe)."""
    if isinstance(recipe, DelayedScaling):
        return recipe.fp8_format.fwd
    return recipe.fp8_format.for_role("weight")


def weight_quantizer(recipe: Float8CurrentScaling) -> CurrentScalingQuantizer:
    """The weight quantizer ``recipe``'s scheme uses on a layer that is not tensor
    parallel; the gathered weight serves GEMMs whose quantizer equals it."""
    return CurrentScalingQuantizer(
        fmt=weight_format(recipe),
        power_2_scales=recipe.use_power_2_scales,
        amax_epsilon=recipe.amax_epsilon,
    )


class FSDPFloat8Weight(torch.Tensor):
    """A high-precision ``fc.Linear`` weight whose FSDP2 all-gather carries FP8.

    It behaves as the tensor it wraps (every op runs on that tensor; the ops FSDP2 uses to
    shard and copy it keep the wrapper), plus FSDP2's ``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather``. ``recipe`` is the per-tensor recipe gathered for.
    """

    _tensor: torch.Tensor
    recipe: Recipe

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: Recipe) -> FSDPFloat8Weight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, recipe: Recipe) -> None:
        self._tensor = tensor
        self.recipe = recipe
        # (scale, (version, optimizer steps), quantizer) of the last gather: backward's
        # re-gather of the unchanged weight casts it with the forward's scale again.
        self._kept: tuple[torch.Tensor, tuple[int, int], Any] | None = None

    def __repr__(self) -> str:
        return f"FSDPFloat8Weight({self._tensor!r}, recipe={self.recipe!r})"

    @property
    def fmt(self) -> str:
        return weight_format(self.recipe)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        recipe = None

        def unwrap(t: Any) -> Any:
            nonlocal recipe
            if isinstance(t, cls):
                recipe = t.recipe
                return t._tensor
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in _KEEP_WRAPPED:
            return out
        if func in (aten.copy_.default, aten.zero_.default):  # in place: the wrapper itself
            return args[0]
        return tree_map(lambda t: cls(t, recipe) if isinstance(t, torch.Tensor) else t, out)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], self.recipe

    @staticmethod
    def __tensor_unflatten__(inner: dict, recipe: Any, size: Any, stride: Any) -> Any:
        return FSDPFloat8Weight(inner["_tensor"], recipe)

    # -- FSDP2's extension hooks ---------------------------------------------------------
    def _current_scale(self, group: Any) -> torch.Tensor:
        """Current scaling: the scale of the whole weight this shard belongs to."""
        amax = tensor_amax(self._tensor)
        all_reduce_max(amax, group)
        return self._scale_from(amax)

    def _scale_from(self, amax: torch.Tensor) -> torch.Tensor:
        recipe = self.recipe
        return scale_from_amax(
            amax,
            ELEMENT_MAX[self.fmt],
            power_2=recipe.use_power_2_scales,
            epsilon=recipe.amax_epsilon,
        )

    def _delayed(self, module: Any, mesh: Any) -> tuple[torch.Tensor, Any, Float8Tensor]:
        """Delayed scaling in a forward: under an autocast with this recipe, the module's
        own weight quantizer (its scale from the history; the shard's amax recorded,
        max-reduced over the autocast's group when it exits, as the whole weight's would
        be). Anywhere else the module's current weight scale, nothing recorded."""
        frame = get_stack()[0]
        if frame.enabled and frame.recipe == self.recipe:
            if frame.group is None and mesh.size() > 1:
                raise ValueError(
                    "fastcast: DelayedScaling with quantized_all_gather needs "
                    "fc.autocast(amax_reduction_group=...) over the FSDP ranks: each rank "
                    "records its shard's amax, and only the reduction makes it the weight's"
                )
            plan = module._plan
            if plan is None or not plan.matches(frame):
                # Not stored on the module: under torch.compile its forward builds plans of
                # its own (fastcast.compile), and a stored one would reach the trace.
                device = self._tensor.device
                plan = scheme_for(frame.recipe).plan(frame, module._scheme_state, device)
            quantizer = plan.weight_q
            scale = quantizer.scale.clone()  # the scale it casts with (updated in place later)
            return scale, quantizer, quantizer.quantize(self._tensor)
        scale = module._scheme_state[FORWARD].scale_views[1].clone()
        return scale, None, quantize_with_scale(self._tensor, scale, self.fmt, True, False)

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: Any,
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        delayed = isinstance(self.recipe, DelayedScaling)
        key = (self._tensor._version, optimizer_steps(install=True))
        kept = self._kept
        # The weight is unchanged since the last gather: current scaling's scale is the
        # same (no reduction needed); delayed scaling reuses it in backward's re-gather
        # (the forward's scale, whatever the autocast's exit did to the history since).
        if (
            kept is not None
            and kept[1] == key
            and (not delayed or torch._C._current_graph_task_id() != -1)
        ):
            scale, quantizer = kept[0], kept[2]
            q = quantize_with_scale(self._tensor, scale, self.fmt, True, False)
        elif delayed:
            scale, quantizer, q = self._delayed(module, mesh)
        else:
            scale, quantizer = self._current_scale(mesh.get_group()), weight_quantizer(self.recipe)
            q = quantize_with_scale(self._tensor, scale, self.fmt, True, False)
        self._kept = (scale, key, quantizer)
        codes = q.data.view(torch.uint8)  # bytes: every backend gathers them
        # Uneven sharding: FSDP2 wants every rank's input at the padded shard size.
        rows = -(-outer_size[0] // mesh.size())
        if codes.shape[0] != rows:
            codes = F.pad(codes, (0, 0, 0, rows - codes.shape[0]))
        return (codes,), (q.scale_inv, quantizer, self.fmt)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> Any:
        (codes,) = all_gather_outputs
        scale_inv, quantizer, fmt = metadata
        if out is not None:  # later gathers: the same buffers, a new scale
            out._scale_inv, out.quantizer = scale_inv, quantizer
            return None
        # The dtype FSDP2's mixed precision gives the unsharded parameters (bf16, say).
        gathered = GatheredFloat8Weight(codes, scale_inv, quantizer, fmt, param_dtype)
        return gathered, (codes,)


class GatheredFloat8Weight(torch.Tensor):
    """The unsharded weight FSDP2 builds from the gathered FP8 codes (``[out, in]`` bytes,
    a view of its all-gather buffer) and the scale's inverse. ``quantized(columnwise)`` is
    the ``Float8Tensor`` the GEMMs take; any other use sees ``dequantize()``.
    ``quantizer`` is the quantizer it was cast for (None: none a GEMM would use)."""

    _codes: torch.Tensor
    _scale_inv: torch.Tensor
    quantizer: Any
    fmt: str

    @staticmethod
    def __new__(
        cls,
        codes: torch.Tensor,
        scale_inv: torch.Tensor,
        quantizer: Any,
        fmt: str,
        dtype: torch.dtype,
    ) -> GatheredFloat8Weight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            codes.size(),
            strides=codes.stride(),
            storage_offset=codes.storage_offset(),
            dtype=dtype,
            device=codes.device,
            requires_grad=False,
        )

    def __init__(
        self,
        codes: torch.Tensor,
        scale_inv: torch.Tensor,
        quantizer: Any,
        fmt: str,
        dtype: torch.dtype,
    ) -> None:
        self._codes = codes
        self._scale_inv = scale_inv
        self.quantizer = quantizer
        self.fmt = fmt

    def __repr__(self) -> str:
        return f"GatheredFloat8Weight(shape={tuple(self.shape)}, fmt={self.fmt})"

    def dequantize(self) -> torch.Tensor:
        fp8 = self._codes.view(FP8_DTYPES[self.fmt])
        return (fp8.float() * self._scale_inv).to(self.dtype)

    def quantized(self, columnwise: bool) -> Float8Tensor:
        """The gathered weight as the GEMMs' operand: what ``quantizer`` makes of the
        whole high-precision weight (same scale, same codes)."""
        data = self._codes.view(FP8_DTYPES[self.fmt])
        return Float8Tensor.assemble(
            self.fmt,
            self.shape,
            self.dtype,
            data,
            self._scale_inv,
            WHOLE,
            transposed_codes(data) if columnwise else None,
            self._scale_inv if columnwise else None,
            WHOLE,
        )

    def fc_quantized(self, quantizer: Any, columnwise: bool) -> Float8Tensor | None:
        """The GEMM operand when this weight was cast for ``quantizer`` (None otherwise:
        the caller quantizes it, and so sees the dequantized weight)."""
        mine = self.quantizer
        if mine is None:
            return None
        if quantizer != mine and not (
            # Delayed scaling: any quantizer over the same scale slot (plans are rebuilt).
            isinstance(mine, DelayedScalingQuantizer)
            and type(quantizer) is DelayedScalingQuantizer
            and quantizer.meta is mine.meta
            and quantizer.index == mine.index
        ):
            return None
        return self.quantized(columnwise)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _VIEWS:
            # FSDP2 views the gathered buffer as the parameter: the codes follow.
            this = args[0]
            codes = func(this._codes, *args[1:], **(kwargs or {}))
            return cls(codes, this._scale_inv, this.quantizer, this.fmt, this.dtype)
        # Anything else computes with the dequantized weight (in high precision).
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        # torch.compile copies this context: a delayed-scaling quantizer (live state, a
        # process group) stays out, so a traced weight is used dequantized.
        quantizer = self.quantizer if isinstance(self.quantizer, CurrentScalingQuantizer) else None
        return ["_codes", "_scale_inv"], (quantizer, self.fmt, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, size: Any, stride: Any) -> Any:
        return GatheredFloat8Weight(inner["_codes"], inner["_scale_inv"], *meta)


def check_recipe(recipe: Recipe | None) -> None:
    """A clear error for a recipe whose all-gather cannot be quantized (yet)."""
    if not isinstance(recipe, (Float8CurrentScaling, DelayedScaling)):
        raise NotImplementedError(
            f"fastcast.convert: quantized_all_gather supports the per-tensor recipes "
            f"(Float8CurrentScaling, DelayedScaling) only, got "
            f"{type(recipe).__name__}; pass quantized_all_gather=False (FSDP2 then gathers "
            "the weights in high precision)"
        )


def enable_quantized_all_gather(layers: Iterable[Any], recipe: Recipe) -> int:
    """Wrap the weight of each ``fc.Linear`` of ``layers`` (not yet sharded) in an
    ``FSDPFloat8Weight`` for ``recipe``; the number wrapped. ``fc.convert(...,
    quantized_all_gather=True)`` calls this; call ``fully_shard`` after it."""
    check_recipe(recipe)
    count = 0
    for layer in layers:
        weight = layer._parameters["weight"]
        if isinstance(weight, FSDPFloat8Weight):
            weight = weight._tensor
        elif weight.__class__ is not nn.Parameter:
            raise ValueError(
                f"fastcast.convert: quantized_all_gather: {layer._where()} has a "
                f"{type(weight).__name__} weight; convert before fully_shard or parallelize_module"
            )
        wrapped = FSDPFloat8Weight(weight.data, recipe)
        layer._parameters["weight"] = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
        if not getattr(layer, "_fc_plain_state", False):
            layer.register_state_dict_post_hook(plain_weight_in_state_dict)
            layer._fc_plain_state = True
        layer._weight_cache.clear()
        count += 1
    return count


def plain_weight_in_state_dict(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post-hook of a layer with an ``FSDPFloat8Weight``: its state dict holds
    the plain high-precision weight (a DTensor of plain shards under FSDP2), so that
    checkpoints load anywhere (``torch.load(weights_only=True)``, DCP, unconverted models)."""
    key = prefix + "weight"
    weight = state_dict.get(key)
    if isinstance(weight, FSDPFloat8Weight):
        state_dict[key] = weight._tensor.detach()
    elif isinstance(getattr(weight, "_local_tensor", None), FSDPFloat8Weight):
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        local = weight._local_tensor._tensor.detach()
        state_dict[key] = DTensor.from_local(
            local,
            weight.device_mesh,
            weight.placements,
            run_check=False,
            shape=weight.shape,
            stride=weight.stride(),
        )


@torch.no_grad()
def precompute_float8_scales(module: nn.Module) -> None:
    """Every FSDP2-sharded ``FSDPFloat8Weight`` below ``module`` (current scaling): the
    scales of the next all-gathers, from one all-reduce of all their amaxes (per process
    group). Call it after the optimizer step; without it each weight reduces its own amax
    at its gather. (Delayed scaling needs none: its amaxes go with the autocast's.)"""
    groups: dict[Any, list[FSDPFloat8Weight]] = {}
    for param in module.parameters():
        local = getattr(param, "_local_tensor", None)
        if isinstance(local, FSDPFloat8Weight) and isinstance(local.recipe, Float8CurrentScaling):
            groups.setdefault(param.device_mesh.get_group(), []).append(local)
    for group, weights in groups.items():
        amaxes = torch.stack([tensor_amax(w._tensor) for w in weights])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
        steps = optimizer_steps(install=True)
        for w, amax in zip(weights, amaxes):
            key = (w._tensor._version, steps)
            w._kept = (w._scale_from(amax), key, weight_quantizer(w.recipe))
