"""What a recipe means for the grouped GEMM, asked of its scheme: a ``GroupedScaling``."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..recipe import Recipe
from ..schemes import scheme_for


@dataclasses.dataclass(frozen=True)
class GroupedScaling:
    """The scheme's answers for one recipe (``grouped_scaling``): its GEMM family (which
    decides the hardware kernel; None: the quantizers' own), the quantizers of the three
    roles (``Scheme.grouped_quantizers``), what the experts' features must be multiples
    of, and whether the weight gradient runs in high precision; ``recipe``: whose."""

    family: str | None
    input_q: Any
    weight_q: Any
    grad_q: Any
    alignment: int
    wgrad_high_precision: bool = False
    recipe: Recipe | None = None

    def quantizer(self, role: str) -> Any:
        return {"input": self.input_q, "weight": self.weight_q}.get(role, self.grad_q)

    def fmt(self, role: str) -> str:
        return self.quantizer(role).fmt

    @property
    def block(self) -> int:
        """What each token group is padded to for the weight-gradient operands: the block
        their column-wise layouts have along the tokens (``token_block``; 1: none)."""
        return max(getattr(q, "token_block", 1) for q in (self.input_q, self.grad_q))


def grouped_scaling(recipe: Recipe) -> GroupedScaling:
    """The grouped GEMM's meaning of ``recipe``; a TypeError for recipes it cannot run."""
    scheme = scheme_for(recipe)
    input_q, weight_q, grad_q = scheme.grouped_quantizers(recipe)
    return GroupedScaling(
        scheme.family,
        input_q,
        weight_q,
        grad_q,
        scheme.alignment(recipe),
        scheme.wgrad_high_precision(recipe),
        recipe,
    )
