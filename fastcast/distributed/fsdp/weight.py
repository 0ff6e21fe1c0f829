"""``FSDPFloat8Weight``: the parameter wrapper whose FSDP2 all-gather carries the weight
quantized for its recipe, and ``fc.convert``'s entry points (``enable_quantized_all_gather``,
``check_recipe``, ``precompute_float8_scales``)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from ...quantizers.base import shard_amax
from ...recipe import Recipe
from ...runtime.state import optimizer_steps
from ...schemes import scheme_for
from ..agreement import agree
from . import blocks, gathered, tensorwise

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


def gather_kind(recipe: Recipe | None) -> str | None:
    """How ``recipe``'s weights gather quantized: ``"tensor"`` (one scale: codes travel,
    the scale is reduced), ``"blocks"`` (codes and block scales travel), or None (not
    quantized: the weight quantizer does not tell its scale blocks)."""
    if recipe is None:
        return None
    if tensorwise.supports(recipe):
        return "tensor"
    if blocks.supports(recipe):
        return "blocks"
    return None


_GATHER = "FSDP2's quantized all-gather (fc.convert(..., recipe=..., quantized_all_gather=True))"


class FSDPFloat8Weight(torch.Tensor):
    """A high-precision ``fc.Linear`` weight whose FSDP2 all-gather carries it quantized.

    It behaves as the tensor it wraps (every op runs on that tensor; the ops FSDP2 uses to
    shard and copy it keep the wrapper), plus FSDP2's ``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather``. ``recipe`` is the recipe gathered for (one ``gather_kind`` knows;
    the name dates from the per-tensor FP8 recipes), ``where`` names the layer.
    """

    _tensor: torch.Tensor
    recipe: Recipe
    where: str

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: Recipe, where: str = "") -> FSDPFloat8Weight:
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

    def __init__(self, tensor: torch.Tensor, recipe: Recipe, where: str = "") -> None:
        self._tensor = tensor
        self.recipe = recipe
        self.where = where
        # The last gather's reductions, kept while the weight is unchanged: per tensor
        # (scale, (version, optimizer steps), quantizer); block formats ((version,
        # optimizer steps), reduced amaxes).
        self._kept: Any = None
        self._warned = False
        self._split: bool | None = None  # block formats: layouts split between the passes
        # Block formats: gathered quantized yet, and in which dtype (precompute's amaxes).
        self._gathered = False
        self._param_dtype: torch.dtype | None = None

    def __repr__(self) -> str:
        return f"FSDPFloat8Weight({self._tensor!r}, recipe={self.recipe!r})"

    @property
    def fmt(self) -> str:
        return tensorwise.weight_format(self.recipe)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        spec = None

        def unwrap(t: Any) -> Any:
            nonlocal spec
            if isinstance(t, cls):
                spec = (t.recipe, t.where)
                return t._tensor
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in _KEEP_WRAPPED:
            return out
        if func in (aten.copy_.default, aten.zero_.default):  # in place: the wrapper itself
            return args[0]
        return tree_map(lambda t: cls(t, *spec) if isinstance(t, torch.Tensor) else t, out)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], (self.recipe, self.where)

    @staticmethod
    def __tensor_unflatten__(inner: dict, spec: Any, size: Any, stride: Any) -> Any:
        return FSDPFloat8Weight(inner["_tensor"], *spec)

    def _scale_from(self, amax: torch.Tensor) -> torch.Tensor:
        return tensorwise.scale_from(self.recipe, amax)

    # -- FSDP2's extension hooks ---------------------------------------------------------
    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: Any,
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        # Ranks converted for different recipes would gather mismatched layouts: refused.
        agree(self.recipe, self._tensor.device, _GATHER, mesh.get_group())
        if gather_kind(self.recipe) == "tensor":
            inputs, meta = tensorwise.pre_all_gather(self, mesh, outer_size, module)
            return inputs, ("tensor", meta)
        param_dtype = getattr(mp_policy, "param_dtype", None)
        if mesh.size() == 1:
            # Nothing goes on a wire, and FSDP2 hands a group of one only the first
            # input over (no scales): the weight as it is, quantized by the GEMMs.
            return self._high_precision(mesh, outer_size, param_dtype, "")
        quantizer = blocks.weight_quantizer(self.recipe)
        why = blocks.unaligned(quantizer, outer_size[0], mesh.size())
        if why:
            return self._high_precision(mesh, outer_size, param_dtype, why)
        inputs, wire = blocks.pre_all_gather(self, mesh, outer_size, param_dtype)
        return inputs, ("blocks", wire)

    def _high_precision(
        self, mesh: Any, outer_size: torch.Size, param_dtype: Any, why: str
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The shard as FSDP2 gathers it without the hooks (a weight the recipe's blocks
        do not shard): the GEMMs then quantize the gathered weight as one process does."""
        if why and not self._warned:
            self._warned = True
            warnings.warn(
                f"fastcast: quantized_all_gather: {self.where or 'a weight'} of shape "
                f"{tuple(outer_size)} is gathered in high precision over {mesh.size()} "
                f"ranks: {why} ({type(self.recipe).__name__})",
                stacklevel=2,
            )
        tensor = self._tensor.to(param_dtype or self._tensor.dtype)
        rows = -(-outer_size[0] // mesh.size())
        if tensor.shape[0] != rows:
            tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, rows - tensor.shape[0]))
        return (tensor,), ("high", None)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> Any:
        kind, payload = metadata
        if kind == "tensor":
            return tensorwise.post_all_gather(all_gather_outputs, payload, param_dtype, out)
        if kind == "blocks":
            return gathered.post_all_gather(all_gather_outputs, payload, param_dtype, out)
        if out is not None:  # high precision: the buffer, refilled
            return None
        (tensor,) = all_gather_outputs
        return tensor, (tensor,)


# Gathered weights by kind, for callers that test for either.
GATHERED = (tensorwise.GatheredFloat8Weight, gathered.GatheredQuantizedWeight)


def check_recipe(recipe: Recipe | None) -> None:
    """A clear error for a recipe whose all-gather cannot be quantized."""
    if gather_kind(recipe) is None:
        raise NotImplementedError(
            "fastcast.convert: quantized_all_gather needs a recipe whose weight quantizer "
            "tells how its scales shard (Quantizer.scale_blocks, as every built-in "
            f"recipe's does), got {type(recipe).__name__}; pass quantized_all_gather=False "
            "(FSDP2 then gathers the weights in high precision)"
        )


def enable_quantized_all_gather(layers: Iterable[Any], recipe: Recipe) -> int:
    """Wrap the weight of each ``fc.Linear`` of ``layers`` (not yet sharded) in an
    ``FSDPFloat8Weight`` for ``recipe``; the number wrapped. ``fc.convert(...,
    quantized_all_gather=True)`` calls this; call ``fully_shard`` after it."""
    check_recipe(recipe)
    count = 0
    for layer in layers:
        if getattr(layer, "_fc_transposed", False) and gather_kind(recipe) == "blocks":
            # fc.Conv1D stores [in, out]: FSDP2 would shard the input features, and the
            # GEMMs take weight.t(). Its blocks are not the shard's: gathered as it is.
            warnings.warn(
                f"fastcast.convert: quantized_all_gather: {layer._where()} stores its weight "
                f"transposed; {type(recipe).__name__} gathers it in high precision",
                stacklevel=3,
            )
            continue
        weight = layer._parameters["weight"]
        if isinstance(weight, FSDPFloat8Weight):
            weight = weight._tensor
        elif weight.__class__ is not nn.Parameter:
            raise ValueError(
                f"fastcast.convert: quantized_all_gather: {layer._where()} has a "
                f"{type(weight).__name__} weight; convert before fully_shard or parallelize_module"
            )
        wrapped = FSDPFloat8Weight(weight.data, recipe, layer._where())
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
    """Every FSDP2-sharded ``FSDPFloat8Weight`` below ``module`` whose gather reduces an
    amax (current scaling's scale; NVFP4's tensor scale; row-wise scaling's column
    scales): the reductions of the next all-gathers, from one all-reduce of all their
    amaxes per process group. Call it after the optimizer step; without it each weight
    reduces its own at its gather. (Delayed scaling needs none: its amaxes go with the
    autocast's. A block-scaled weight joins from its second step: its first gather tells
    the dtype it is gathered in.)"""
    groups: dict[Any, list[tuple[FSDPFloat8Weight, torch.Tensor]]] = {}
    for param in module.parameters():
        local = getattr(param, "_local_tensor", None)
        if not isinstance(local, FSDPFloat8Weight):
            continue
        kind = gather_kind(local.recipe)
        if kind == "tensor" and not scheme_for(local.recipe).stateful:
            amax = shard_amax(tensorwise.weight_quantizer(local.recipe), local._tensor, 0)
        elif kind == "blocks":
            amax = blocks.local_amax(local)
        else:
            amax = None
        if amax is not None:
            groups.setdefault(param.device_mesh.get_group(), []).append((local, amax))
    for group, entries in groups.items():
        flat = torch.cat([amax.reshape(-1) for _, amax in entries])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        steps = optimizer_steps(install=True)
        for (w, amax), reduced in zip(entries, flat.split([a.numel() for _, a in entries])):
            reduced = reduced.reshape(amax.shape)
            if gather_kind(w.recipe) == "tensor":
                key = (w._tensor._version, steps)
                w._kept = (w._scale_from(reduced), key, tensorwise.weight_quantizer(w.recipe))
            else:
                blocks.keep_reduced(w, reduced)
