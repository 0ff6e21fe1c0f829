"""``FastcastPrecision``: Lightning's ``Trainer(plugins=[FastcastPrecision(recipe=r)])``.

Like Lightning's own ``TransformerEnginePrecision``, the plugin converts the
LightningModule's layers when the trainer sets the model up (``convert_module``, before
the strategy wraps it in DDP or FSDP) and runs every training, validation, test and
predict step inside ``fc.autocast(recipe=r)`` (``forward_context``). The backward runs
outside it, as in a hand-written fastcast loop. Parameters stay in their own dtype (FP32
master weights unless the module was built otherwise), so the plugin reports Lightning's
``"32-true"``.

Needs the ``lightning`` package (``pip install lightning``, or ``fastcast[integrations]``);
importing this module imports it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..autocast import autocast
from ..nn.convert import convert
from ..recipe import Recipe

try:
    from lightning.pytorch.plugins.precision import Precision
except ImportError as error:  # said plainly: fastcast itself does not depend on lightning
    raise ImportError(
        "fastcast.integrations.lightning needs the lightning package "
        "(pip install lightning, or pip install 'fastcast[integrations]')"
    ) from error


class FastcastPrecision(Precision):
    """Train a LightningModule's ``nn.Linear`` layers in FP8/FP4 with ``recipe``.

    - ``recipe``: a fastcast recipe; None runs ``fc.autocast``'s default (the best this
      machine runs) and converts without a recipe (``fc.convert(module)``).
    - ``module_filter_fn`` and ``keep_head``: passed to ``fc.convert``.
    - ``convert_layers=False``: leave the module as it is (the user converted it, with
      ``fc.convert``, before giving it to the trainer); the steps still run in
      ``fc.autocast``.
    """

    precision = "32-true"

    def __init__(
        self,
        recipe: Recipe | None = None,
        *,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        keep_head: bool | None = None,
        convert_layers: bool = True,
    ) -> None:
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"FastcastPrecision: recipe must be a fastcast recipe, got {recipe!r}")
        if convert_layers.__class__ is not bool:
            raise TypeError(
                f"FastcastPrecision: convert_layers must be a bool, got {convert_layers!r}"
            )
        super().__init__()
        self.recipe = recipe
        self.module_filter_fn = module_filter_fn
        self.keep_head = keep_head
        self.convert_layers = convert_layers

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module``'s layers in place (``fc.convert``), unless told not to."""
        if self.convert_layers:
            convert(module, self.module_filter_fn, recipe=self.recipe, keep_head=self.keep_head)
        return module

    def forward_context(self) -> autocast:
        """The context of every step: a fresh ``fc.autocast(recipe=...)``."""
        return autocast(recipe=self.recipe)

    def __repr__(self) -> str:
        return f"FastcastPrecision(recipe={self.recipe!r})"
