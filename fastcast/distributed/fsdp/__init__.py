"""Quantized FSDP2 all-gather: ``fc.Linear`` weights gathered as codes and scales.

``fc.convert(model, recipe=..., quantized_all_gather=True)`` wraps each ``fc.Linear``
weight in an ``FSDPFloat8Weight`` (the parameter stays a leaf with the same values, dtype
and state-dict key). ``fully_shard`` then shards it as it shards any parameter, and uses
the two extension hooks FSDP2 looks for on a parameter's local shard:

- ``fsdp_pre_all_gather``: each rank quantizes its shard as one process quantizes the
  whole weight, and the codes (as bytes) and block scales are what goes on the wire;
  scales that span shards come from amaxes max-reduced over the FSDP group. Per-tensor
  recipes (``tensorwise``): one scale from the global amax. Row-wise, block, MXFP8 and
  NVFP4 (``blocks``): scales local to rows or blocks, which need shards of whole blocks
  (else that weight is gathered in high precision, with a warning).
- ``fsdp_post_all_gather``: the gathered codes and scales become the unsharded parameter
  (``GatheredFloat8Weight``, ``GatheredQuantizedWeight``). Under an ``fc.autocast`` whose
  weight quantizer is the one the weight was gathered for, the GEMMs take that quantized
  weight as it is (and its column-wise layout for the input gradient), with no second
  cast and no high-precision gather in backward.

The gathered format is chosen once, at ``fc.convert`` time: FSDP2 allocates each
parameter's all-gather buffers at the first gather and keeps their sizes and dtypes, so
the gather cannot switch between quantized (autocast steps) and high precision
(evaluation outside autocast). Backward's re-gather (``reshard_after_forward=True``) runs
outside the autocast block anyway. Anything else that reads the gathered weight
(``F.linear`` outside autocast, an autocast with another recipe) sees its dequantized
value: the weight rounded to the format (a relative error up to 2**-4 per element in
E4M3), not the high-precision weight. Evaluate with ``quantized_all_gather=False`` if
that matters, or gather the full weights first.

Current scaling: one all-reduce per weight and step, by default (the scale is kept while
the weight is unchanged, so backward's re-gather reuses it). ``precompute_float8_scales(
model)`` after the optimizer step does all of a model's weights in one all-reduce instead
(torchao's ``precompute_float8_dynamic_scale_for_fsdp``).
"""

from __future__ import annotations

from .gathered import GatheredQuantizedWeight
from .tensorwise import GatheredFloat8Weight, weight_format, weight_quantizer
from .weight import (
    GATHERED,
    FSDPFloat8Weight,
    check_recipe,
    enable_quantized_all_gather,
    gather_kind,
    plain_weight_in_state_dict,
    precompute_float8_scales,
)

__all__ = [
    "GATHERED",
    "gather_kind",
    "FSDPFloat8Weight",
    "GatheredFloat8Weight",
    "GatheredQuantizedWeight",
    "check_recipe",
    "enable_quantized_all_gather",
    "plain_weight_in_state_dict",
    "precompute_float8_scales",
    "weight_format",
    "weight_quantizer",
]
