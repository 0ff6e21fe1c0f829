"""What each recipe means for the grouped GEMM: a ``GroupedScaling``.

One frozen value per recipe (family, element format per role, scale rules, block and
tile extents), so the GEMMs below never look at the recipe itself; ``grouped_scaling``
refuses recipes the grouped GEMM cannot run.
"""

from __future__ import annotations

import dataclasses

from ..recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from ..reference import hadamard
from ..reference.mx import MX_BLOCK
from ..reference.nvfp4 import BLOCK as NVFP4_BLOCK
from ..tensor import BLOCKWISE, MXFP8, NVFP4, ROWWISE, TENSORWISE

BLOCK_TILE = 128  # Float8BlockScaling's block extent


@dataclasses.dataclass(frozen=True)
class GroupedScaling:
    """What one recipe means for the grouped GEMM (``grouped_scaling`` builds it)."""

    family: str
    fmt_input: str
    fmt_weight: str
    fmt_grad: str
    power_2: bool = False
    epsilon: float = 0.0
    margin: int = 0
    # Weight tile extent along N as well as K (128x128 blocks, NVFP4 16x16); 1: 1-D blocks.
    weight_tile: int = 1
    stochastic_grad: bool = False
    rht: tuple[int, ...] | None = None
    wgrad_high_precision: bool = False

    def fmt(self, role: str) -> str:
        return {"input": self.fmt_input, "weight": self.fmt_weight}.get(role, self.fmt_grad)

    @property
    def block(self) -> int:
        """The block extent along the contraction dim (1: no blocks)."""
        return {BLOCKWISE: BLOCK_TILE, MXFP8: MX_BLOCK, NVFP4: NVFP4_BLOCK}.get(self.family, 1)

    @property
    def alignment(self) -> int:
        """What the experts' in and out features must be multiples of."""
        return {MXFP8: MX_BLOCK, NVFP4: NVFP4_BLOCK}.get(self.family, 16)


def grouped_scaling(recipe: Recipe) -> GroupedScaling:
    """The grouped GEMM's meaning of ``recipe``; TypeError for recipes it cannot run.

    ``DelayedScaling`` runs as per-tensor current scaling per expert and token group
    (its format and margin; the experts keep no amax history: a history per token group
    would describe groups whose sizes change every step).
    """
    if isinstance(recipe, (Float8CurrentScaling, DelayedScaling)):
        fmt = recipe.fp8_format
        current = isinstance(recipe, Float8CurrentScaling)
        return GroupedScaling(
            TENSORWISE,
            fmt.for_role("input"),
            fmt.for_role("weight"),
            fmt.for_role("grad_output"),
            power_2=current and recipe.use_power_2_scales,
            epsilon=recipe.amax_epsilon if current else 0.0,
            margin=0 if current else recipe.margin,
        )
    if isinstance(recipe, Float8RowwiseScaling):
        fmt = recipe.fp8_format
        return GroupedScaling(
            ROWWISE,
            fmt.for_role("input"),
            fmt.for_role("weight"),
            fmt.for_role("grad_output"),
            power_2=recipe.use_power_2_scales,
            wgrad_high_precision=recipe.wgrad_high_precision,
        )
    if isinstance(recipe, Float8BlockScaling):
        if recipe.x_block_scaling_dim != 1 or recipe.grad_block_scaling_dim != 1:
            raise TypeError(
                "grouped GEMM: Float8BlockScaling needs 1x128 blocks for the input and "
                "gradient (x_block_scaling_dim=1, grad_block_scaling_dim=1); 128x128 tiles "
                "would span several experts' tokens"
            )
        fmt = recipe.fp8_format
        return GroupedScaling(
            BLOCKWISE,
            fmt.for_role("input"),
            fmt.for_role("weight"),
            fmt.for_role("grad_output"),
            power_2=not recipe.use_f32_scales,
            weight_tile=BLOCK_TILE if recipe.w_block_scaling_dim == 2 else 1,
        )
    if isinstance(recipe, MXFP8BlockScaling):
        fmt = recipe.fp8_format
        return GroupedScaling(
            MXFP8, fmt.for_role("input"), fmt.for_role("weight"), fmt.for_role("grad_output")
        )
    if isinstance(recipe, NVFP4BlockScaling):
        return GroupedScaling(
            NVFP4,
            "e2m1",
            "e2m1",
            "e2m1",
            weight_tile=NVFP4_BLOCK if recipe.weight_2d_blocks else 1,
            stochastic_grad=recipe.stochastic_rounding,
            rht=hadamard.sign_vector(recipe.rht_seed) if recipe.random_hadamard_transform else None,
        )
    raise TypeError(
        f"grouped GEMM: no grouped scaling for {type(recipe).__name__}; the experts run "
        "Float8CurrentScaling, DelayedScaling, Float8RowwiseScaling, Float8BlockScaling, "
        "MXFP8BlockScaling and NVFP4BlockScaling"
    )
