"""``CustomRecipe``: the user's ``qfactory(role)`` makes the quantizers."""

from __future__ import annotations

from typing import Any

from ..quantizers.base import Blocks, Quantizer, scale_blocks
from ..recipe import CustomRecipe
from .base import Scheme, register_scheme


@register_scheme(CustomRecipe)
class CustomScheme(Scheme):
    """Stateless from fastcast's side; the quantizers' types decide each GEMM's family,
    so support is not known in advance (``family`` None)."""

    family = None

    def quantizer(self, recipe: CustomRecipe, role: str, group: Any = None) -> Quantizer:
        quantizer = recipe.qfactory(role)
        if not callable(getattr(quantizer, "quantize", None)):
            raise TypeError(
                f"CustomRecipe.qfactory({role!r}) returned {type(quantizer).__name__}, "
                "which has no quantize(x, rowwise=..., columnwise=...) method"
            )
        return quantizer

    def scale_blocks(self, recipe: CustomRecipe, role: str) -> Blocks | None:
        try:  # the user's factory may not make a quantizer for every role
            quantizer = self.quantizer(recipe, role)
        except TypeError:
            return None
        return scale_blocks(quantizer)
