"""The quantizer protocol and the arithmetic every scaling family shares."""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch

from ..formats import FP8_DTYPES
from ..tensor import QuantizedTensor
from .reduction import GroupMax

ROLES = ("input", "weight", "grad_output")
PER_ROW = (1, 0)  # the block of one scale per row (``tensor.QuantizedTensor``)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@runtime_checkable
class Quantizer(Protocol):
    """Turns a high-precision tensor into a QuantizedTensor.

    ``rowwise`` produces the layout scaled along the last dim, ``columnwise`` the
    transposed one scaled along the other dim (what backward GEMMs contract over).

    What consumers ask a quantizer beyond ``quantize`` (tensor and sequence parallelism,
    the FSDP2 gather, compile, ``fc.inspect``; none of them names a quantizer class).
    Each is optional: a quantizer without it gets the default of the function below of
    the same name, which is what a ``CustomRecipe``'s quantizers get.

    - ``scale_blocks``: ``(block, block_t)``, the blocks the row-wise layout ``[R, K]``
      and the column-wise layout ``[K, R]`` scale over, each in its layout's own
      ``(rows, cols)``, 0 for a whole dim (a ``Float8Tensor``'s ``block``/``block_t``:
      ``((0, 0), (0, 0))`` per tensor, ``((1, 0), (1, 0))`` per row). ``block_t`` equal to
      ``block`` transposed (square tiles, one scale) means the column-wise layout is the
      row-wise one transposed. Default None: not known (parallel layers and the FSDP2
      gather then do not quantize shards).
    - ``over_shards(reduce, dim)``: the quantizer for a shard of a tensor split along
      ``dim`` of its ``[R, K]`` view (0: rows, the tokens; 1: K) whose codes and scales
      are those this quantizer gives the whole tensor: every amax a scale takes across
      ``dim`` goes through ``reduce`` (``amax -> amax``, max-reduced in place, e.g.
      ``reduction.GroupMax(group)``); blocks along ``dim`` are local, the caller keeps
      shard boundaries on them. Default: the quantizer itself (it sees its shard).
    - ``shard_amax(x, dim)``: what ``over_shards(reduce, dim).quantize(x)`` hands
      ``reduce`` (one tensor), so a caller can reduce many tensors' in one collective;
      None when it reduces nothing or not one tensor (its quantize then reduces by
      itself). Default None.
    - ``pure``: its output depends on its input alone (no state, no random draws), so
      equal quantizers make equal codes of equal inputs (shared gathers; compiled
      graphs may hold it). Default False.
    - ``scale_for(amax)``: per-tensor quantizers: the scale of a tensor whose amax is
      ``amax`` (the FSDP2 gather casts shards with the whole weight's). Default: none.
    - ``casts_like(other)``: whether ``other`` casts exactly as this one does (a weight
      gathered for one serves the other). Default: equality.
    - ``from_history``: its scale comes from earlier steps' amaxes, not the tensor's
      own (``fc.inspect`` reports headroom against the recipe's margin). Default False.

    Optionally, for grouped (mixture-of-experts) GEMMs, ``quantize_groups(m, groups, *,
    columnwise)`` quantizes each group of rows as a tensor of its own, on the device, and
    ``token_block`` says what its column-wise layout needs each group to start at a
    multiple of (``quantizers.groups``); a quantizer without them is called per group.
    """

    fmt: str

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False
    ) -> QuantizedTensor: ...


Blocks = tuple[tuple[int, int], tuple[int, int]]
PER_TENSOR_BLOCKS: Blocks = ((0, 0), (0, 0))


def scale_blocks(quantizer: object) -> Blocks | None:
    """``quantizer.scale_blocks``, or None where it does not say (see ``Quantizer``)."""
    return getattr(quantizer, "scale_blocks", None)


def over_shards(quantizer: Quantizer, reduce: Any, dim: int) -> Quantizer:
    """``quantizer.over_shards(reduce, dim)``, or the quantizer itself (see ``Quantizer``)."""
    method = getattr(quantizer, "over_shards", None)
    return quantizer if method is None else method(reduce, dim)


def over_group_shards(quantizer: Quantizer, group: Any, dim: int) -> Quantizer:
    """``over_shards`` with the amaxes max-reduced over the process group ``group``: how
    tensor and sequence parallelism shard a quantizer without naming its reducer."""
    return over_shards(quantizer, GroupMax(group), dim)


def shard_amax(quantizer: object, x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """``quantizer.shard_amax(x, dim)``, or None (see ``Quantizer``)."""
    method = getattr(quantizer, "shard_amax", None)
    return None if method is None else method(x, dim)


def is_pure(quantizer: object) -> bool:
    """``quantizer.pure``, False where it does not say (see ``Quantizer``)."""
    return getattr(quantizer, "pure", False) is True


def casts_like(quantizer: object, other: object) -> bool:
    """``quantizer.casts_like(other)``, else equality (see ``Quantizer``)."""
    method = getattr(quantizer, "casts_like", None)
    return quantizer == other if method is None else bool(method(other))


def extent(blocks: Blocks, dim: int) -> tuple[int, int]:
    """The blocks' extents along ``dim`` of the ``[R, K]`` matrix: the row-wise layout's,
    then the column-wise one's (which holds the matrix transposed); 0: the whole dim."""
    (r0, r1), (c0, c1) = blocks
    return (r0, c1) if dim == 0 else (r1, c0)


def shard_multiple(blocks: Blocks | None, dim: int) -> int:
    """What a shard's extent along ``dim`` must be a multiple of for every block of both
    layouts to lie in one shard (scales spanning the dim are reduced instead: 1)."""
    if blocks is None:
        return 1
    return math.lcm(1, *(e for e in extent(blocks, dim) if e > 0))


def check_input(x: object, what: str = "input") -> torch.Tensor:
    """Refuse what cannot be quantized, naming the problem."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{what} must be float32, bfloat16 or float16 to be quantized, got {x.dtype}"
        )
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension to be quantized")
    return x


def check_fp8_format(owner: str, fmt: object) -> str:
    """``fmt`` if it names an FP8 element format (``e4m3`` or ``e5m2``), else ValueError."""
    if fmt not in FP8_DTYPES:
        raise ValueError(f"{owner}: fmt must be e4m3 or e5m2, got {fmt!r}")
    return fmt  # type: ignore[return-value]


def transposed_codes(codes: torch.Tensor) -> torch.Tensor:
    """The column-wise layout ``[K, R]`` of codes cast in the matrix's own layout ``[R, K]``
    (per-tensor and row-wise FP8: casting is elementwise, so the transposed bytes are the
    codes of the transposed matrix). The CPU GEMM and the emulation take the transposed
    view as it is; CUDA kernels, and Inductor's lowering of the CPU kernel, want it
    materialised."""
    codes_t = codes.t()
    if not codes_t.is_cpu or torch.compiler.is_compiling():
        codes_t = codes_t.contiguous()
    return codes_t
