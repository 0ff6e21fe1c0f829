"""The block-scaled recipes' gathered weight: ``Float8RowwiseScaling``,
``Float8BlockScaling``, ``MXFP8BlockScaling``, ``NVFP4BlockScaling``.

Each rank quantizes its shard (rows ``[r0, r1)`` of the ``[out, in]`` weight) with the
recipe's weight quantizer, and FSDP2 gathers the codes and the block scales. The result
is what that quantizer makes of the whole weight, code for code and scale for scale,
when every block of every layout the GEMMs take lies inside one shard:

- the row-wise layout (forward GEMM) scales blocks along ``in``: per row (row-wise), 1x128
  or 128x128 tiles (block), 1x32 (MXFP8), 1x16 or 16x16 (NVFP4): local to the rows;
- the column-wise layout (the input gradient's GEMM) scales blocks along ``out``: the
  128x128 and 16x16 tiles are the row-wise ones transposed (nothing more goes on the
  wire: the gathered weight transposes them); 1x32 (MXFP8), 1x128 and 1x16 blocks along
  ``out`` need shards of whole blocks and travel as a second set of codes and scales;
  row-wise scaling's per-column scales span every shard: their amaxes (one per input
  feature, or one per tensor with ``wgrad_high_precision``) are max-reduced over the
  FSDP group, each rank casts its shard with them, and they go as metadata;
- NVFP4's FP32 tensor scale comes from the global amax (max-reduced over the group).

A weight whose rows do not split into equal shards of whole blocks (``row_alignment``)
is gathered in high precision instead, with one warning naming it (the single-process
quantization of the gathered weight then applies, as without ``quantized_all_gather``).

Reductions are kept while the weight is unchanged (its version and the optimizer steps),
so backward's re-gather casts again without a collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ...formats import FP8_DTYPES
from ...quantizers.block import BlockScalingQuantizer
from ...quantizers.mx import MXFP8Quantizer
from ...quantizers.nvfp4 import NVFP4Quantizer
from ...quantizers.rowwise import RowwiseQuantizer
from ...recipe import (
    Float8BlockScaling,
    Float8RowwiseScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from ...reference.mx import MX_BLOCK
from ...reference.nvfp4 import BLOCK, pack_e2m1
from ...reference.tiles import TILE
from ...runtime.state import optimizer_steps
from ...schemes import scheme_for
from ...tensor import NVFP4Tensor, QuantizedTensor
from ..amax import all_reduce_max
from .tensorwise import VIEWS

BLOCK_RECIPES = (Float8RowwiseScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)


def weight_quantizer(recipe: Recipe) -> Any:
    """The weight quantizer of ``recipe``'s scheme (a layer that is not tensor parallel)."""
    return scheme_for(recipe).quantizer(recipe, "weight")


def transposable(quantizer: Any) -> bool:
    """Whether the column-wise layout is the row-wise one transposed (square tiles)."""
    if isinstance(quantizer, BlockScalingQuantizer):
        return quantizer.block_dim == 2
    return isinstance(quantizer, NVFP4Quantizer) and quantizer.block_2d


def row_alignment(quantizer: Any) -> int:
    """The rows a shard must be a multiple of so that every block of both layouts lies in
    one shard (row-wise scaling: its column amaxes are reduced instead)."""
    if isinstance(quantizer, BlockScalingQuantizer):
        return TILE  # 128x128 tiles, or 1x128 tiles of the column-wise layout
    if isinstance(quantizer, MXFP8Quantizer):
        return MX_BLOCK
    if isinstance(quantizer, NVFP4Quantizer):
        return BLOCK
    return 1


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


@dataclasses.dataclass
class Wire:
    """What travels beside the gathered tensors (metadata): the quantized tensor's class
    and fields, the scales every rank holds whole (reduced), the tensors' own dtypes."""

    cls: type
    fmt: str
    shape: torch.Size
    block: tuple[int, int]
    block_t: tuple[int, int]
    dtypes: tuple[torch.dtype, ...]
    quantizer: Any
    replicated: dict[str, torch.Tensor]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as something every backend gathers: FP8 as bytes, FP32 as it is."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype in (*FP8_DTYPES.values(), torch.float8_e4m3fn) else t


def _reducer(weight: Any, group: Any) -> Any:
    """The ``reduce`` callbacks of the quantizers: all-reduce max the first time the
    weight is cast at this version, replay the reduced amaxes afterwards."""
    key = (weight._tensor._version, optimizer_steps(install=True))
    kept = weight._kept
    replay = list(kept[1]) if kept is not None and kept[0] == key else None
    record: list[torch.Tensor] = []
    weight._kept = (key, record)

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        if replay:
            amax.copy_(replay.pop(0))
        else:
            all_reduce_max(amax, group)
        record.append(amax.clone())
        return amax

    return reduce


def pre_all_gather(
    weight: Any, mesh: Any, outer_size: torch.Size, param_dtype: torch.dtype | None
) -> tuple[tuple[torch.Tensor, ...], Wire]:
    """The shard quantized with the recipe's weight quantizer: its codes and block
    scales to gather, the reduced scales as metadata."""
    quantizer = weight_quantizer(weight.recipe)
    tensor = weight._tensor
    if param_dtype is not None:  # what FSDP2's mixed precision gathers (and one casts)
        tensor = tensor.to(param_dtype)
    two = not transposable(quantizer)
    kwargs: dict[str, Any] = {}
    reduce = _reducer(weight, mesh.get_group())
    if isinstance(quantizer, NVFP4Quantizer):
        kwargs["reduce_amax"] = reduce
    elif isinstance(quantizer, RowwiseQuantizer):
        kwargs["reduce_columns"] = reduce
    q = quantizer.quantize(tensor, rowwise=True, columnwise=two, **kwargs)
    inputs = [_bytes(q.data), _bytes(q.scale_inv)]
    replicated: dict[str, torch.Tensor] = {}
    if isinstance(q, NVFP4Tensor):
        replicated["global_scale_inv"] = q.global_scale_inv
    if two:
        inputs.append(_bytes(q.data_t.t()))  # the rows along dim 0, as FSDP2 gathers them
        if isinstance(quantizer, RowwiseQuantizer):
            replicated["scale_inv_t"] = q.scale_inv_t  # per column: every rank's, whole
        else:
            inputs.append(_bytes(q.scale_inv_t.t()))
    dtypes = (q.data.dtype, q.scale_inv.dtype)
    wire = Wire(type(q), q.fmt, outer_size, q.block, q.block_t, dtypes, quantizer, replicated)
    return tuple(inputs), wire


def post_all_gather(
    outputs: tuple[torch.Tensor, ...], wire: Wire, param_dtype: torch.dtype, out: Any
) -> Any:
    """``fsdp_post_all_gather``: a ``GatheredQuantizedWeight`` over the gathered buffers
    (later gathers refill them: only the reduced scales change)."""
    if out is not None:
        out._wire = wire
        return None
    return GatheredQuantizedWeight(outputs, wire, param_dtype), tuple(outputs)


def _transposed_nvfp4(data: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes ``[R, K/2]`` of 16x16 tiles to those of the transposed matrix
    ``[K, R/2]`` (the tiles transpose onto themselves: the same codes, moved)."""
    codes = torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(data.shape[0], -1)
    return pack_e2m1(codes.t())


class GatheredQuantizedWeight(torch.Tensor):
    """The unsharded weight FSDP2 builds from a block-scaled recipe's gathered codes and
    scales (views of its all-gather buffers). ``quantized(columnwise)`` is the quantized
    tensor the GEMMs take; any other use sees ``dequantize()``."""

    _parts: tuple[torch.Tensor, ...]
    _wire: Wire

    @staticmethod
    def __new__(
        cls, parts: tuple[torch.Tensor, ...], wire: Wire, dtype: torch.dtype
    ) -> GatheredQuantizedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, wire.shape, dtype=dtype, device=parts[0].device, requires_grad=False
        )

    def __init__(self, parts: tuple[torch.Tensor, ...], wire: Wire, dtype: torch.dtype) -> None:
        self._parts = tuple(parts)
        self._wire = wire

    def __repr__(self) -> str:
        return f"GatheredQuantizedWeight(shape={tuple(self.shape)}, {self._wire.cls.__name__})"

    @property
    def quantizer(self) -> Any:
        return self._wire.quantizer

    def quantized(self, columnwise: bool) -> QuantizedTensor:
        """What ``quantizer`` makes of the whole weight (same codes, same scales)."""
        wire, parts = self._wire, self._parts
        data = parts[0].view(wire.dtypes[0])
        scale_inv = parts[1].view(wire.dtypes[1])
        data_t = scale_inv_t = None
        if columnwise:
            if len(parts) > 2:  # a column-wise layout of its own, gathered
                data_t = parts[2].view(wire.dtypes[0]).t().contiguous()
                scale_inv_t = wire.replicated.get("scale_inv_t")
                if scale_inv_t is None:
                    scale_inv_t = parts[3].view(wire.dtypes[1]).t().contiguous()
            else:  # square tiles: the row-wise layout transposed
                nvfp4 = wire.cls is NVFP4Tensor
                data_t = _transposed_nvfp4(data) if nvfp4 else data.t().contiguous()
                scale_inv_t = scale_inv.t().contiguous()
        fields = dict(
            fmt=wire.fmt,
            shape=wire.shape,
            dtype=self.dtype,
            data=data,
            scale_inv=scale_inv,
            block=wire.block,
            data_t=data_t,
            scale_inv_t=scale_inv_t,
            block_t=wire.block_t,
        )
        extra = {k: v for k, v in wire.replicated.items() if k != "scale_inv_t"}
        return wire.cls(**fields, **extra)

    def fc_quantized(self, quantizer: Any, columnwise: bool) -> QuantizedTensor | None:
        """The GEMM operand when this weight was cast for ``quantizer`` (None otherwise:
        the caller quantizes it, and so sees the dequantized weight)."""
        return self.quantized(columnwise) if quantizer == self.quantizer else None

    def dequantize(self) -> torch.Tensor:
        return self.quantized(False).dequantize(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        this = args[0] if args else None
        if func in VIEWS and isinstance(this, cls):
            # FSDP2 views the gathered parameter at its own size: the parts stay.
            probe = torch.empty(this.shape, device="meta")
            if func(probe, *args[1:], **(kwargs or {})).shape == this.shape:
                return cls(this._parts, this._wire, this.dtype)
        # Anything else computes with the dequantized weight (in high precision).
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        names = [f"_p{i}" for i in range(len(self._parts))]
        for name, part in zip(names, self._parts):
            setattr(self, name, part)
        return names, (self._wire, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, size: Any, stride: Any) -> Any:
        parts = tuple(inner[f"_p{i}"] for i in range(len(inner)))
        return GatheredQuantizedWeight(parts, *meta)
