"""The per-tensor recipes' gathered weight (one scale: ``Scheme.scale_blocks`` of the
weight is ``PER_TENSOR_BLOCKS``): FP8 codes and one scale for the whole weight.

The scale comes from the amax of the *whole* weight: the shard's amax max-reduced over the
FSDP group (``scale_for`` of a stateless scheme's weight quantizer), or a stateful
scheme's, whose amaxes the autocast reduces over its group. Every rank then casts its
shard exactly as one process casts the whole weight (same scale, same codes), and the
gathered codes are the weight's.
Backward's column-wise layout is the transposed codes (the cast is elementwise), so the
re-gather carries the same bytes again.

One all-reduce per weight and step by default (the scale is kept while the weight is
unchanged, so backward's re-gather reuses it); ``precompute_float8_scales`` does all of a
model's weights in one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from ...formats import FP8_DTYPES
from ...quantizers.base import PER_TENSOR_BLOCKS, Quantizer, casts_like, is_pure, transposed_codes
from ...quantizers.reduction import all_reduce_max
from ...quantizers.tensorwise import quantize_with_scale
from ...recipe import Recipe
from ...reference.cast import tensor_amax
from ...runtime.state import get_stack, optimizer_steps
from ...schemes import scheme_for
from ...tensor import WHOLE, Float8Tensor

aten = torch.ops.aten

# Views FSDP2 makes of the gathered parameter (they keep the quantized codes).
VIEWS = (aten.as_strided.default, aten.view.default, aten.detach.default, aten.alias.default)


def supports(recipe: Recipe) -> bool:
    """Whether ``recipe``'s weights gather as one scale and codes: per-tensor scales, from
    the weight quantizer's ``scale_for`` or a stateful scheme's state."""
    scheme = scheme_for(recipe)
    if scheme.scale_blocks(recipe, "weight") != PER_TENSOR_BLOCKS:
        return False
    return scheme.stateful or hasattr(weight_quantizer(recipe), "scale_for")


def weight_format(recipe: Recipe) -> str:
    """The element format of ``recipe``'s weights."""
    return scheme_for(recipe).weight_format(recipe)


def weight_quantizer(recipe: Recipe) -> Quantizer:
    """The weight quantizer ``recipe``'s (stateless) scheme uses on a layer that is not
    tensor parallel; the gathered weight serves GEMMs whose quantizer casts like it."""
    return scheme_for(recipe).quantizer(recipe, "weight")


def scale_from(recipe: Recipe, amax: torch.Tensor) -> torch.Tensor:
    """The scale of a weight whose (global) amax is ``amax`` (a stateless scheme)."""
    return weight_quantizer(recipe).scale_for(amax)


def _stateful(weight: Any, module: Any, mesh: Any) -> tuple[torch.Tensor, Any, Float8Tensor]:
    """A stateful scheme (delayed scaling) in a forward: under an autocast with this
    recipe, the module's own weight quantizer (its scale from the history; the shard's
    amax recorded, max-reduced over the autocast's group when it exits, as the whole
    weight's would be). Anywhere else the module's current weight scale, nothing
    recorded."""
    frame = get_stack()[0]
    tensor, recipe = weight._tensor, weight.recipe
    if frame.enabled and frame.recipe == recipe:
        if frame.group is None and mesh.size() > 1:
            raise ValueError(
                f"fastcast: {type(recipe).__name__} with quantized_all_gather needs "
                "fc.autocast(amax_reduction_group=...) over the FSDP ranks: each rank "
                "records its shard's amax, and only the reduction makes it the weight's"
            )
        plan = module._plan
        if plan is None or not plan.matches(frame):
            # Not stored on the module: under torch.compile its forward builds plans of
            # its own (fastcast.compile), and a stored one would reach the trace.
            plan = scheme_for(frame.recipe).plan(frame, module._scheme_state, tensor.device)
        quantizer = plan.weight_q
        scale = quantizer.scale.clone()  # the scale it casts with (updated in place later)
        return scale, quantizer, quantizer.quantize(tensor)
    frozen = scheme_for(recipe).state_weight_quantizer(recipe, module._scheme_state)
    return frozen.scale, None, frozen.quantize(tensor)


def pre_all_gather(
    weight: Any, mesh: Any, outer_size: torch.Size, module: Any
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """``FSDPFloat8Weight.fsdp_pre_all_gather`` for a per-tensor recipe: the shard's FP8
    codes (bytes: every backend gathers them), the scale's inverse as metadata."""
    recipe = weight.recipe
    fmt = weight_format(recipe)
    delayed = scheme_for(recipe).stateful
    key = (weight._tensor._version, optimizer_steps(install=True))
    kept = weight._kept
    # The weight is unchanged since the last gather: current scaling's scale is the
    # same (no reduction needed); delayed scaling reuses it in backward's re-gather
    # (the forward's scale, whatever the autocast's exit did to the history since).
    if (
        kept is not None
        and kept[1] == key
        and (not delayed or torch._C._current_graph_task_id() != -1)
    ):
        scale, quantizer = kept[0], kept[2]
        q = quantize_with_scale(weight._tensor, scale, fmt, True, False)
    elif delayed:
        scale, quantizer, q = _stateful(weight, module, mesh)
    else:
        amax = tensor_amax(weight._tensor)
        all_reduce_max(amax, mesh.get_group())
        quantizer = weight_quantizer(recipe)
        scale = quantizer.scale_for(amax)
        q = quantize_with_scale(weight._tensor, scale, fmt, True, False)
    weight._kept = (scale, key, quantizer)
    codes = q.data.view(torch.uint8)
    # Uneven sharding: FSDP2 wants every rank's input at the padded shard size.
    rows = -(-outer_size[0] // mesh.size())
    if codes.shape[0] != rows:
        codes = F.pad(codes, (0, 0, 0, rows - codes.shape[0]))
    return (codes,), (q.scale_inv, quantizer, fmt)


def post_all_gather(
    outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, out: Any
) -> Any:
    """``fsdp_post_all_gather`` for a per-tensor recipe: a ``GatheredFloat8Weight``."""
    (codes,) = outputs
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
        # (Delayed scaling: any quantizer over the same scale slot; plans are rebuilt.)
        if not (quantizer == mine or casts_like(mine, quantizer)):
            return None
        return self.quantized(columnwise)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in VIEWS:
            # FSDP2 views the gathered buffer as the parameter: the codes follow.
            this = args[0]
            codes = func(this._codes, *args[1:], **(kwargs or {}))
            return cls(codes, this._scale_inv, this.quantizer, this.fmt, this.dtype)
        # Anything else computes with the dequantized weight (in high precision).
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        # torch.compile copies this context: a quantizer with live state (delayed
        # scaling's) stays out, so a traced weight is used dequantized.
        quantizer = self.quantizer if is_pure(self.quantizer) else None
        return ["_codes", "_scale_inv"], (quantizer, self.fmt, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, size: Any, stride: Any) -> Any:
        return GatheredFloat8Weight(inner["_codes"], inner["_scale_inv"], *meta)
