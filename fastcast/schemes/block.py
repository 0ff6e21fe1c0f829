"""``Float8BlockScaling``: FP8 with one scale per 1x128 or 128x128 tile."""

from __future__ import annotations

from typing import Any

from ..quantizers.base import Quantizer
from ..quantizers.block import BlockScalingQuantizer
from ..recipe import Float8BlockScaling
from ..tensor import BLOCKWISE
from .base import Scheme, register_scheme


@register_scheme(Float8BlockScaling)
class BlockScalingScheme(Scheme):
    """Stateless: each role has its tile shape (``*_block_scaling_dim``: 1 for 1x128, 2
    for 128x128); ``use_f32_scales=False`` rounds scales to powers of two."""

    family = BLOCKWISE

    def quantizer(
        self, recipe: Float8BlockScaling, role: str, group: Any = None
    ) -> BlockScalingQuantizer:
        dims = {
            "input": recipe.x_block_scaling_dim,
            "weight": recipe.w_block_scaling_dim,
            "grad_output": recipe.grad_block_scaling_dim,
        }
        return BlockScalingQuantizer(
            fmt=recipe.fp8_format.for_role(role),
            block_dim=dims[role],
            power_2_scales=not recipe.use_f32_scales,
        )

    def grouped_quantizers(self, recipe: Float8BlockScaling) -> tuple[Quantizer, ...]:
        if recipe.x_block_scaling_dim != 1 or recipe.grad_block_scaling_dim != 1:
            raise TypeError(
                "grouped GEMM: Float8BlockScaling needs 1x128 blocks for the input and "
                "gradient (x_block_scaling_dim=1, grad_block_scaling_dim=1); 128x128 tiles "
                "would span several experts' tokens"
            )
        return self.quantizers(recipe)
