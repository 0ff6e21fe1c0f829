"""The gathered weight of recipes whose weight scales are per row or per block (any
``Scheme.scale_blocks`` other than one scale per tensor).

Each rank quantizes its shard (rows ``[r0, r1)`` of the ``[out, in]`` weight) with the
recipe's weight quantizer ``over_shards`` the rows, and FSDP2 gathers the codes and the
block scales. The invariant: the result is what that quantizer makes of the whole weight,
code for code and scale for scale. Blocks along the rows must lie inside one shard
(``row_alignment``; else the weight is gathered in high precision, with one warning);
scales spanning the rows (per column, NVFP4's tensor scale) take amaxes max-reduced over
the FSDP group and go as metadata; layouts whose blocks are equal (square tiles) gather
once, the column-wise one being the row-wise one transposed. Reductions are kept while
the weight is unchanged (its version and the optimizer steps), so backward's re-gather
casts again without a collective.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...quantizers.base import (
    PER_TENSOR_BLOCKS,
    over_shards,
    scale_blocks,
    shard_amax,
    shard_multiple,
)
from ...quantizers.reduction import all_reduce_max
from ...recipe import Recipe
from ...reference.cast import as_matrix
from ...reference.nvfp4 import pack_e2m1
from ...runtime.state import optimizer_steps
from ...schemes import scheme_for
from ..collectives import all_gather_into


def supports(recipe: Recipe) -> bool:
    """Whether ``recipe``'s weight gathers here: its quantizer tells its scale blocks,
    and they are not one per tensor (``tensorwise``)."""
    blocks = scheme_for(recipe).scale_blocks(recipe, "weight")
    return blocks is not None and blocks != PER_TENSOR_BLOCKS


def weight_quantizer(recipe: Recipe) -> Any:
    """The weight quantizer of ``recipe``'s scheme (a layer that is not tensor parallel)."""
    return scheme_for(recipe).quantizer(recipe, "weight")


def transposable(quantizer: Any) -> bool:
    """Whether the column-wise layout is the row-wise one transposed (its blocks are the
    row-wise ones transposed: square tiles)."""
    blocks = scale_blocks(quantizer)
    return blocks is not None and blocks[1] == blocks[0][::-1]


def row_alignment(quantizer: Any) -> int:
    """The rows a shard must be a multiple of so that every block of both layouts lies in
    one shard (scales spanning the rows reduce their amaxes instead)."""
    return shard_multiple(scale_blocks(quantizer), 0)


def _replicated_columns(quantizer: Any) -> bool:
    """Whether the column-wise scales span every row (per column): the same on every rank
    after the reduction, they go as metadata rather than on the wire."""
    return scale_blocks(quantizer)[1][1] == 0


def unaligned(quantizer: Any, rows: int, world: int) -> str:
    """Why a weight of ``rows`` rows cannot be gathered quantized over ``world`` ranks
    ("" when it can)."""
    align = row_alignment(quantizer)
    if rows % world:
        return f"its {rows} rows do not split into {world} equal shards"
    if (rows // world) % align:
        return (
            f"its shards of {rows // world} rows are not multiples of the {align}-row "
            f"blocks of {type(quantizer).__name__}"
        )
    return ""


# How a weight goes on the wire (``Wire.layout``):
# - "one": the row-wise layout alone (square tiles: the column-wise one is its transpose);
# - "both": both layouts in every gather (a weight FSDP2 does not re-gather in backward);
# - "row" / "col": the forward's gather carries the row-wise layout, backward's re-gather
#   the column-wise one, in the same buffers (codes, then the scales as padded bytes).
LAYOUTS = ("one", "both", "row", "col")


@dataclasses.dataclass
class Wire:
    """What travels beside the gathered tensors (metadata): the quantized tensor's class
    and fields, the scales every rank holds whole (reduced), the codes' and scales'
    dtypes, the layout, and (split layouts) the shape of one rank's scales on the wire;
    ``source`` and ``group``: the shard and the FSDP group, for a gather of its own."""

    cls: type
    fmt: str
    shape: torch.Size
    block: tuple[int, int]
    block_t: tuple[int, int]
    dtypes: tuple[torch.dtype, torch.dtype]
    quantizer: Any
    replicated: dict[str, torch.Tensor]
    layout: str
    scale_shape: tuple[int, ...] = ()
    source: Any = None
    group: Any = None
    param_dtype: Any = None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as something every backend gathers: FP8 as bytes, FP32 as it is."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _reducer(weight: Any, group: Any) -> Any:
    """The ``reduce`` callbacks of the quantizers: the amaxes reduced for this version of
    the weight (by an earlier gather or ``precompute_float8_scales``), in call order;
    an all-reduce max for any beyond them, kept for the next gathers."""
    key = (weight._tensor._version, optimizer_steps(install=True))
    kept = weight._kept
    if kept is None or kept[0] != key:
        kept = weight._kept = (key, [])
    reduced: list[torch.Tensor] = kept[1]
    calls = [0]

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        i = calls[0]
        calls[0] += 1
        if i < len(reduced):
            return amax.copy_(reduced[i])
        all_reduce_max(amax, group)
        reduced.append(amax.clone())
        return amax

    return reduce


def _blocks_over(n: int, extent: int) -> int:
    return 1 if extent == 0 else -(-n // extent)


def _split_scale_bytes(quantizer: Any, rows: int, cols: int, itemsize: int) -> int:
    """Bytes of one rank's scales on the wire in the split layouts: the larger of the
    row-wise and the column-wise ones (per-column scales go as metadata) of a
    ``[rows, cols]`` shard, ``itemsize`` bytes a scale."""
    (r0, r1), (c0, c1) = scale_blocks(quantizer)
    row_scales = _blocks_over(rows, r0) * _blocks_over(cols, r1)
    col_scales = 0 if c1 == 0 else _blocks_over(cols, c0) * _blocks_over(rows, c1)
    return itemsize * max(row_scales, col_scales)


def reshards_after_forward(weight: Any) -> bool:
    """Whether FSDP2 re-gathers ``weight`` (a shard) in backward: its parameter group
    reshards after forward. False when that cannot be told (both layouts then go in
    every gather, which is right either way)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping  # noqa: PLC0415
    except ImportError:  # pragma: no cover - a torch without it
        return False
    for ref in list(_module_state_mapping.values()):
        state = ref() if callable(ref) else ref
        group = getattr(state, "_fsdp_param_group", None)
        for param in getattr(group, "fsdp_params", ()):
            if param._sharded_local_tensor is weight:
                return group.post_forward_mesh_info is not None
    return False


def layout_for(weight: Any, quantizer: Any) -> str:
    """The layout of this gather (``LAYOUTS``); the split is decided at the first."""
    if transposable(quantizer):
        return "one"
    if weight._split is None:
        weight._split = reshards_after_forward(weight)
    if not weight._split:
        return "both"
    return "col" if torch._C._current_graph_task_id() != -1 else "row"


def wire_inputs(
    weight: Any,
    quantizer: Any,
    layout: str,
    group: Any,
    outer_size: torch.Size,
    param_dtype: torch.dtype | None,
) -> tuple[list[torch.Tensor], Wire]:
    """The shard quantized with the recipe's weight quantizer for ``layout``: the codes
    and block scales to gather (rows along dim 0), the reduced scales as metadata."""
    tensor = weight._tensor
    if param_dtype is not None:  # what FSDP2's mixed precision gathers (and one casts)
        tensor = tensor.to(param_dtype)
    rowwise, columnwise = layout != "col", layout in ("both", "col")
    shard_q = over_shards(quantizer, _reducer(weight, group), 0)
    q = shard_q.quantize(tensor, rowwise=rowwise, columnwise=columnwise)
    replicated: dict[str, torch.Tensor] = {}
    if getattr(q, "global_scale_inv", None) is not None:  # a tensor scale (NVFP4's)
        replicated["global_scale_inv"] = q.global_scale_inv
    inputs: list[torch.Tensor] = []
    if rowwise:
        inputs += [_bytes(q.data), _bytes(q.scale_inv)]
    if columnwise:
        inputs.append(_bytes(q.data_t.t()))  # the rows along dim 0, as FSDP2 gathers them
        if _replicated_columns(quantizer):
            replicated["scale_inv_t"] = q.scale_inv_t  # per column: every rank's, whole
        else:
            inputs.append(_bytes(q.scale_inv_t.t()))
    data = q.data if rowwise else q.data_t
    scales = q.scale_inv if rowwise else q.scale_inv_t
    dtypes = (data.dtype, scales.dtype)
    wire = Wire(
        type(q), q.fmt, outer_size, q.block, q.block_t, dtypes, quantizer, replicated, layout
    )
    if layout in ("row", "col"):  # the scales as bytes, padded to one size for both
        scale = inputs[1] if len(inputs) > 1 else inputs[0].new_empty(0)
        wire.scale_shape = tuple(scale.shape)
        flat = scale.reshape(-1).view(torch.uint8)
        rows = outer_size[0] // weight_world(group)
        size = _split_scale_bytes(quantizer, rows, outer_size[1], scales.element_size())
        inputs = [inputs[0], F.pad(flat, (0, size - flat.numel()))]
    return inputs, wire


def weight_world(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else 1


def local_amax(weight: Any) -> torch.Tensor | None:
    """What the next gather of ``weight`` (a shard) max-reduces, computed as its quantizer
    computes it: NVFP4's tensor amax (of the finite magnitudes), row-wise scaling's column
    amaxes (its amax with ``wgrad_high_precision``). None when it reduces nothing, or was
    never gathered quantized (its gathers' dtype is not known yet)."""
    if not weight._gathered:
        return None
    quantizer = weight_quantizer(weight.recipe)
    m = as_matrix(weight._tensor.to(weight._param_dtype or weight._tensor.dtype))
    return shard_amax(quantizer, m, 0)


def keep_reduced(weight: Any, amax: torch.Tensor) -> None:
    """The reduced ``amax`` for the next gathers of ``weight`` while it is unchanged."""
    weight._kept = ((weight._tensor._version, optimizer_steps(install=True)), [amax])


def pre_all_gather(
    weight: Any, mesh: Any, outer_size: torch.Size, param_dtype: torch.dtype | None
) -> tuple[tuple[torch.Tensor, ...], Wire]:
    """``fsdp_pre_all_gather`` of a block-scaled recipe's shard (``wire_inputs``)."""
    weight._gathered, weight._param_dtype = True, param_dtype
    quantizer = weight_quantizer(weight.recipe)
    group = mesh.get_group()
    layout = layout_for(weight, quantizer)
    inputs, wire = wire_inputs(weight, quantizer, layout, group, outer_size, param_dtype)
    wire.source, wire.group, wire.param_dtype = weight, group, param_dtype
    return tuple(inputs), wire


def gather_own(wire: Wire, layout: str) -> tuple[torch.Tensor, ...]:
    """``layout`` of ``wire.source`` gathered by a collective of its own (not FSDP2's):
    the outputs as FSDP2 would hand them over, and the metadata."""
    inputs, own = wire_inputs(
        wire.source, wire.quantizer, layout, wire.group, wire.shape, wire.param_dtype
    )
    world = weight_world(wire.group)
    outputs = []
    for t in inputs:
        out = t.new_empty((world * t.shape[0], *t.shape[1:]))
        all_gather_into(out, t.contiguous(), wire.group)
        outputs.append(out)
    own.source, own.group, own.param_dtype = wire.source, wire.group, wire.param_dtype
    return tuple(outputs), own


def col_scale_shape(quantizer: Any, rows: int, cols: int) -> tuple[int, int]:
    """The shape of the column-wise scales of a ``[rows, cols]`` weight (split layouts)."""
    c0, c1 = scale_blocks(quantizer)[1]  # the column-wise layout [cols, rows]'s blocks
    return (_blocks_over(cols, c0), _blocks_over(rows, c1))


def split_scales(outputs: tuple[torch.Tensor, ...], wire: Wire) -> torch.Tensor:
    """The gathered scales of a split layout: each rank's bytes, unpadded, as its scales
    in their dtype, the ranks' rows one after the other."""
    world = weight_world(wire.group)
    shape = wire.scale_shape
    n = math.prod(shape) * wire.dtypes[1].itemsize
    per_rank = outputs[1].reshape(world, -1)[:, :n].contiguous()
    return per_rank.view(wire.dtypes[1]).reshape(world * shape[0], *shape[1:])


def transposed_nvfp4(data: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes ``[R, K/2]`` of 16x16 tiles to those of the transposed matrix
    ``[K, R/2]`` (the tiles transpose onto themselves: the same codes, moved)."""
    codes = torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(data.shape[0], -1)
    return pack_e2m1(codes.t())
