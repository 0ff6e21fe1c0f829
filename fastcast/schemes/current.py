"""``Float8CurrentScaling``: per-tensor FP8 with the scale taken from the tensor itself."""

from __future__ import annotations

from typing import Any

from ..quantizers.tensorwise import CurrentScalingQuantizer
from ..recipe import Float8CurrentScaling
from ..tensor import TENSORWISE
from .base import Scheme, register_scheme


@register_scheme(Float8CurrentScaling)
class CurrentScalingScheme(Scheme):
    """Stateless: every tensor gets ``fmt_max / amax(tensor)``. Activation and gradient
    amaxes are max-reduced over the autocast's group (tensor/sequence parallel shards must
    share a scale); weights are never reduced."""

    family = TENSORWISE

    def quantizer(
        self, recipe: Float8CurrentScaling, role: str, group: Any = None
    ) -> CurrentScalingQuantizer:
        return CurrentScalingQuantizer(
            fmt=recipe.fp8_format.for_role(role),
            power_2_scales=recipe.use_power_2_scales,
            amax_epsilon=recipe.amax_epsilon,
            amax_reduction_group=None if role == "weight" else group,
        )
