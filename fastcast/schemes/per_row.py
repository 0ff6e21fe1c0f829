"""``Float8RowwiseScaling``: FP8 with one scale per row, along each GEMM's reduction dim."""

from __future__ import annotations

from typing import Any

from ..quantizers.rowwise import RowwiseQuantizer
from ..recipe import Float8RowwiseScaling
from ..tensor import ROWWISE
from .base import Scheme, register_scheme


@register_scheme(Float8RowwiseScaling)
class RowwiseScalingScheme(Scheme):
    """Stateless. Every layout is scaled per row of the matrix its GEMM contracts along
    its last dim (``RowwiseQuantizer``): input and output gradient per token for the
    forward and dgrad, per feature along the tokens for wgrad; the weight per output
    feature for the forward, per input feature for dgrad, or per tensor for dgrad with
    ``wgrad_high_precision`` (torchao's ``rowwise_with_gw_hp``), whose wgrad GEMM takes
    the unquantized gradient and input. Rows are scaled locally: the autocast's group
    reduces nothing. Layers need the default alignment (16, the tensor cores' GEMM dims);
    any token count works (no block runs along the tokens)."""

    family = ROWWISE

    def wgrad_high_precision(self, recipe: Float8RowwiseScaling) -> bool:
        return recipe.wgrad_high_precision

    def quantizer(
        self, recipe: Float8RowwiseScaling, role: str, group: Any = None
    ) -> RowwiseQuantizer:
        return RowwiseQuantizer(
            fmt=recipe.fp8_format.for_role(role),
            power_2_scales=recipe.use_power_2_scales,
            columnwise_per_tensor=role == "weight" and recipe.wgrad_high_precision,
        )
