"""``NVFP4BlockScaling``: E2M1 in 16-element blocks, E4M3 block and FP32 tensor scales."""

from __future__ import annotations

from typing import Any

from ..quantizers.nvfp4 import NVFP4Quantizer
from ..recipe import NVFP4BlockScaling
from ..reference.hadamard import sign_vector
from ..reference.nvfp4 import BLOCK
from ..tensor import NVFP4
from .base import Scheme, register_scheme


@register_scheme(NVFP4BlockScaling)
class NVFP4Scheme(Scheme):
    """Stateless. Weights use 16x16 tiles with ``weight_2d_blocks`` (a weight and its
    transpose then share one quantization); gradients round stochastically with
    ``stochastic_rounding``; with ``random_hadamard_transform`` the column-wise layouts of
    input and gradient (the weight-gradient GEMM's operands, contracted over the tokens)
    are those of their Hadamard transforms along the tokens, which leaves the product
    unchanged. A layer's features must be multiples of the 16-element block."""

    family = NVFP4

    def alignment(self, recipe: NVFP4BlockScaling) -> int:
        return BLOCK

    def keeps_head(self, recipe: NVFP4BlockScaling) -> bool:
        # NVIDIA's NVFP4 training recipe keeps the output layer in BF16: its rounding
        # errors reach the loss with no later layer to average them (docs/usage.md has
        # the measured effect on the first-hour models).
        return True

    def row_alignment(self, recipe: NVFP4BlockScaling) -> int:
        # Column-wise blocks (the weight gradient's operands) run along the tokens.
        return BLOCK

    def quantizer(self, recipe: NVFP4BlockScaling, role: str, group: Any = None) -> NVFP4Quantizer:
        weight = role == "weight"
        transform = recipe.random_hadamard_transform and not weight
        return NVFP4Quantizer(
            block_2d=weight and recipe.weight_2d_blocks,
            stochastic_rounding=role == "grad_output" and recipe.stochastic_rounding,
            rht=sign_vector(recipe.rht_seed) if transform else None,
            rht_round_to_input_dtype=transform and recipe.rht_round_to_input_dtype,
        )
