"""``MXFP8BlockScaling``: OCP MX, 32 elements along K share one E8M0 scale."""

from __future__ import annotations

from typing import Any

from ..quantizers.mx import MXFP8Quantizer
from ..recipe import MXFP8BlockScaling
from ..reference.mx import MX_BLOCK
from ..tensor import MXFP8
from .base import Scheme, register_scheme


@register_scheme(MXFP8BlockScaling)
class MXFP8Scheme(Scheme):
    """Stateless; a layer's features must be multiples of the 32-element block."""

    family = MXFP8

    def alignment(self, recipe: MXFP8BlockScaling) -> int:
        return MX_BLOCK

    def row_alignment(self, recipe: MXFP8BlockScaling) -> int:
        # Column-wise blocks (the weight gradient's operands) run along the tokens.
        return MX_BLOCK

    def quantizer(self, recipe: MXFP8BlockScaling, role: str, group: Any = None) -> MXFP8Quantizer:
        return MXFP8Quantizer(fmt=recipe.fp8_format.for_role(role))
