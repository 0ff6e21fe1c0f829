"""``fc.convert``: swap ``nn.Linear`` layers for ``fc.Linear`` in place."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from torch import nn

from ..recipe import Recipe
from ..schemes import DEFAULT_ALIGNMENT, scheme_for
from .grouped import convert_experts
from .linear import Linear, guard_loads

logger = logging.getLogger("fastcast")

# Skipped layers the INFO summary names; DEBUG has a line for every layer.
_NAMED_IN_SUMMARY = 10


def convert(
    module: nn.Module,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    recipe: Recipe | None = None,
    quantized_all_gather: bool = False,
) -> nn.Module:
    """Replace every ``nn.Linear`` below ``module`` by an ``fc.Linear`` sharing its
    parameters (not copies), and return ``module``. Mixture-of-experts experts modules of
    transformers 5 (``nn.grouped.convert_experts``) run fastcast's grouped GEMMs from then
    on, with their parameters and state-dict keys unchanged.

    ``module_filter_fn(linear, fully_qualified_name)`` returning False keeps a layer.
    Layers whose features are not multiples of the recipe's block (32 for MXFP8, 16
    otherwise) are kept as they are, since their GEMMs could not run quantized; so are
    subclasses of ``nn.Linear`` (their ``forward`` may differ), ``fc.Linear`` included.
    A bare ``nn.Linear`` passed as ``module`` is converted and returned.

    Each converted layer records its qualified name (``_fc_name``), which its errors
    quote. The ``fastcast`` logger gets one INFO line (how many layers were converted,
    which were skipped and why) and a DEBUG line per layer.

    Checkpoints: ``module`` gets a load pre-hook that validates every ``fc.Linear``'s
    extra state in a state dict before any parameter is written (a refused load changes
    nothing). With ``recipe``, every ``fc.Linear`` below ``module`` (converted now or
    before) gets the per-module state that recipe keeps (``Linear.prepare_state``), so a
    freshly built model has the state-dict layout of a trained one: what DCP, which loads
    in place, needs to resume.

    ``quantized_all_gather=True`` (needs ``recipe``, ``Float8CurrentScaling`` for now):
    FSDP2 (``fully_shard``, applied after this) all-gathers each ``fc.Linear`` weight as
    FP8 codes and a per-tensor scale, which the GEMMs under an ``fc.autocast`` with that
    recipe use directly; outside it the layers see the weight rounded to FP8
    (``fastcast.distributed.fsdp`` explains why). Off by default: FSDP2 then gathers
    the weights in high precision, as for ``nn.Linear``.
    """
    if quantized_all_gather:  # checked before anything changes
        if recipe is None:
            raise ValueError(
                "fastcast.convert: quantized_all_gather=True needs recipe=... (the weights' "
                "gathered format is chosen at conversion)"
            )
        from ..distributed.fsdp import check_recipe  # noqa: PLC0415 - torch.distributed

        check_recipe(recipe)
    align = DEFAULT_ALIGNMENT if recipe is None else scheme_for(recipe).alignment(recipe)
    guard_loads(module)

    def kept_because(layer: nn.Linear, name: str) -> str | None:
        """Why ``layer`` stays as it is, or None to convert it."""
        if type(layer) is not nn.Linear:  # subclasses may override forward: leave them
            if isinstance(layer, Linear):
                return "already fastcast.Linear"
            return f"{type(layer).__name__} is a subclass of nn.Linear"
        features = {"in_features": layer.in_features, "out_features": layer.out_features}
        off = [f"{what}={n}" for what, n in features.items() if n % align]
        if off:
            multiple = "a multiple" if len(off) == 1 else "multiples"
            return f"{' and '.join(off)} not {multiple} of {align}"
        if module_filter_fn is not None and not module_filter_fn(layer, name):
            return "module_filter_fn returned False"
        return None

    report = _Report()
    # One replacement per layer object: a layer registered under two parents (weight
    # tying, shared blocks) stays one module with one set of scales.
    swapped: dict[int, Linear] = {}
    seen: set[int] = set()
    if isinstance(module, nn.Linear):
        seen.add(id(module))
        why = kept_because(module, "")
        report.add("", module, why)
        if why is None:
            report.log()
            new = _swap(module, "")
            if recipe is not None:
                new.prepare_state(recipe)
            if quantized_all_gather:
                _quantize_all_gathers(new, recipe)
            return new
    for name, parent in list(module.named_modules(remove_duplicate=False)):
        # _modules, not named_children(), which would hide the second entry of a layer.
        for child_name, child in list(parent._modules.items()):
            if not isinstance(child, nn.Linear):
                continue
            if id(child) in swapped:
                setattr(parent, child_name, swapped[id(child)])
                continue
            if id(child) in seen:  # a kept layer met again under another name
                continue
            seen.add(id(child))
            full = f"{name}.{child_name}" if name else child_name
            why = kept_because(child, full)
            report.add(full, child, why)
            if why is None:
                swapped[id(child)] = _swap(child, full)
                setattr(parent, child_name, swapped[id(child)])
    report.log()
    # Mixture-of-experts: transformers 5 experts modules (3-D expert parameters).
    convert_experts(module, module_filter_fn, recipe)
    if recipe is not None:
        for layer in module.modules():
            if isinstance(layer, Linear):
                layer.prepare_state(recipe)
    if quantized_all_gather:
        _quantize_all_gathers(module, recipe)
    return module


def _quantize_all_gathers(module: nn.Module, recipe: Recipe) -> None:
    # fastcast.distributed.fsdp imports torch.distributed: only when asked for.
    from ..distributed.fsdp import enable_quantized_all_gather  # noqa: PLC0415

    layers = [m for m in module.modules() if isinstance(m, Linear)]
    enable_quantized_all_gather(layers, recipe)


def keep_high_precision(
    module: nn.Module, *, first: int = 0, last: int = 1, names: Sequence[str] = ()
) -> Callable[[nn.Module, str], bool]:
    """A ``module_filter_fn`` for ``convert`` that keeps chosen layers of ``module`` in
    high precision: the first ``first`` and the last ``last`` ``nn.Linear`` layers below
    it (in registration order, a shared layer counted once), and every layer whose
    qualified name is one of ``names`` or lies below one (``"model.layers.0"`` keeps
    the first block of a Hugging Face Llama).

    The recommended default for NVFP4, ``last=1``, keeps the output layer (a language
    model's ``lm_head``, a regression head): its errors are not averaged away by any
    later layer, and it is a small share of the compute. NVIDIA's NVFP4 pretraining
    recipe keeps a few more (some of the first and last blocks); pass ``first`` or
    ``names`` for those.
    """
    for what, n in (("first", first), ("last", last)):
        if type(n) is not int or n < 0:
            raise ValueError(f"fastcast.keep_high_precision: {what} must be an int >= 0, got {n!r}")
    if isinstance(names, str):
        names = (names,)
    order: list[int] = []
    for layer in module.modules():  # each module once, in registration order
        if isinstance(layer, nn.Linear):
            order.append(id(layer))
    kept = set(order[:first]) | set(order[len(order) - last :] if last else ())
    prefixes = tuple(f"{n}." for n in names)

    def convert_it(layer: nn.Module, name: str) -> bool:
        return id(layer) not in kept and name not in names and not name.startswith(prefixes)

    return convert_it


def _swap(linear: nn.Linear, name: str) -> Linear:
    """An fc.Linear with everything the layer had: the same Parameter objects, buffers,
    hooks, training flag and any attribute a user set on it; and its qualified name."""
    new = Linear.__new__(Linear)
    # The very containers, not copies: hook handles the user holds keep working (they
    # remove from the dict they were registered in). The old layer is being replaced.
    new.__dict__.update(linear.__dict__)
    new._init_runtime()
    if name:
        new._fc_name = name
    return new


class _Report:
    """What convert did, for the ``fastcast`` logger."""

    def __init__(self) -> None:
        self.converted = 0
        self.already = 0
        self.skipped: list[str] = []

    def add(self, name: str, layer: nn.Linear, why: str | None) -> None:
        shown = name or "<root>"
        if why is None:
            self.converted += 1
        elif isinstance(layer, Linear):
            self.already += 1
        else:
            self.skipped.append(f"{shown} ({why})")
        logger.debug(
            "fastcast.convert: %s (in_features=%d, out_features=%d): %s",
            shown,
            layer.in_features,
            layer.out_features,
            "converted" if why is None else f"kept, {why}",
        )

    def log(self) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        line = (
            f"fastcast.convert: converted {self.converted} nn.Linear layer(s) to "
            f"fastcast.Linear; skipped {len(self.skipped)}"
        )
        if self.skipped:
            named = self.skipped[:_NAMED_IN_SUMMARY]
            line += ": " + ", ".join(named)
            if len(self.skipped) > len(named):
                line += f", and {len(self.skipped) - len(named)} more (DEBUG lists them)"
        if self.already:
            line += f"; {self.already} already fastcast.Linear"
        logger.info(line)
