"""``fc.convert``: turn ``nn.Linear`` (and transformers ``Conv1D``) layers into
``fc.Linear`` (``fc.Conv1D``) in place."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ..autocast import autocast as Autocast
from ..recipe import Recipe
from ..schemes import DEFAULT_ALIGNMENT, scheme_for
from ..serialization.extra_state import EXTRA_STATE_KEY
from .autocast_forward import autocast_function, wrap_forward
from .conv1d import HF_MODULE, Conv1D, adopt_hf_conv1d, is_hf_conv1d
from .grouped import convert_experts
from .linear import Linear
from .linear_state import guard_loads

logger = logging.getLogger("fastcast")

# Skipped layers the INFO summary names; DEBUG has a line for every layer.
_NAMED_IN_SUMMARY = 10


def convert(
    module: nn.Module,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    recipe: Recipe | None = None,
    quantized_all_gather: bool = False,
    keep_head: bool | None = None,
    autocast: bool | Autocast = False,
) -> nn.Module:
    """Turn every ``nn.Linear`` below ``module`` into an ``fc.Linear``, and every
    transformers ``Conv1D`` (GPT-2's layers) into an ``fc.Conv1D``, in place (the same
    module objects, parameters, buffers and hooks), and return ``module``.
    Mixture-of-experts experts modules of transformers 5 (``nn.grouped.convert_experts``)
    run fastcast's grouped GEMMs from then on, with their parameters and state-dict keys
    unchanged.

    ``module_filter_fn(layer, fully_qualified_name)`` returning False keeps a layer.
    Layers whose features are not multiples of the recipe's block (32 for MXFP8, 16
    otherwise) are kept as they are, since their GEMMs could not run quantized; so are
    subclasses of ``nn.Linear`` or ``Conv1D`` (their ``forward`` may differ), ``fc.Linear``
    included. ``module`` itself may be such a layer: it is converted in place too.

    Each converted layer records its qualified name (``_fc_name``), which its errors
    quote. The ``fastcast`` logger gets one INFO line (how many layers were converted,
    which were skipped and why) and a DEBUG line per layer. A ``UserWarning`` says when
    no layer was converted, or when more were kept for their shapes or classes than were
    converted (those run in full precision); layers ``module_filter_fn`` kept are not
    counted against it.

    Checkpoints: ``module`` gets a load pre-hook that validates every ``fc.Linear``'s
    extra state in a state dict before any parameter is written (a refused load changes
    nothing), and fills in the keys of tied parameters that a saver wrote once (Hugging
    Face's ``save_pretrained`` leaves ``lm_head.weight`` out of a model whose head shares
    the embedding's weight), so that a strict load of such a file works. With ``recipe``,
    every ``fc.Linear`` below ``module`` (converted now or before) gets the per-module
    state that recipe keeps (``Linear.prepare_state``), so a freshly built model has the
    state-dict layout of a trained one: what DCP, which loads in place, needs to resume.

    ``keep_head``: whether the output head, the last ``nn.Linear``/``Conv1D`` layer (as
    ``keep_high_precision(module)`` counts; a language model's ``lm_head``), stays in
    high precision, whatever ``module_filter_fn`` says of it. ``None``, the default,
    leaves it to the recipe: kept under ``NVFP4BlockScaling`` (NVIDIA's NVFP4 training
    recipe keeps it in BF16; docs/usage.md has the measured effect), converted otherwise
    and without ``recipe``. The first conversion that keeps it by default logs a
    WARNING on the ``fastcast`` logger naming it and ``keep_head=False``, which converts
    it. A module with a single such layer keeps none: that layer is all there is.

    ``quantized_all_gather=True`` (needs ``recipe``, any built-in one): FSDP2
    (``fully_shard``, applied after this) all-gathers each ``fc.Linear`` weight as the
    recipe's codes and scales, which the GEMMs under an ``fc.autocast`` with that recipe
    use directly; outside it the layers see the weight rounded to the format
    (``fastcast.distributed.fsdp`` explains why, and what happens to a weight whose
    shards do not hold whole blocks). Off by default: FSDP2 then gathers the weights in
    high precision, as for ``nn.Linear``. ``autocast=True`` (or an ``fc.autocast``):
    ``module(...)`` runs in ``fc.autocast(recipe=recipe)`` (or one like it); docs/usage.md.
    """
    forward = autocast_function(module, autocast, recipe)  # checked before any change
    if quantized_all_gather:  # checked before anything changes
        if recipe is None:
            raise ValueError(
                "fastcast.convert: quantized_all_gather=True needs recipe=... (the weights' "
                "gathered format is chosen at conversion)"
            )
        from ..distributed.fsdp import check_recipe  # noqa: PLC0415 - torch.distributed

        check_recipe(recipe)
    align = DEFAULT_ALIGNMENT if recipe is None else scheme_for(recipe).alignment(recipe)
    hf_conv1d = _hf_conv1d_class()
    head_by_default = keep_head is None
    if head_by_default:
        keep_head = recipe is not None and scheme_for(recipe).keeps_head(recipe)
    head = keep_high_precision(module) if keep_head and _layer_count(module) > 1 else None

    def kept_because(layer: nn.Module, name: str) -> str | None:
        """Why ``layer`` stays as it is, or None to convert it."""
        if not (type(layer) is nn.Linear or is_hf_conv1d(layer)):
            # Subclasses may override forward: leave them.
            if isinstance(layer, Linear):
                return "already fastcast.Linear"
            base = "nn.Linear" if isinstance(layer, nn.Linear) else "Conv1D"
            return f"{type(layer).__name__} is a subclass of {base}"
        features = {"in_features": _features(layer)[0], "out_features": _features(layer)[1]}
        off = [f"{what}={n}" for what, n in features.items() if n % align]
        if off:
            multiple = "a multiple" if len(off) == 1 else "multiples"
            return f"{' and '.join(off)} not {multiple} of {align}"
        if head is not None and not head(layer, name):
            return _HEAD
        if module_filter_fn is not None and not module_filter_fn(layer, name):
            return _FILTERED
        return None

    def is_layer(child: nn.Module) -> bool:
        return isinstance(child, nn.Linear) or (
            hf_conv1d is not None and isinstance(child, hf_conv1d)
        )

    report = _Report()
    # Each layer object once: a layer registered under two parents (shared blocks) is one
    # module with one set of scales, named after its first place.
    seen: set[int] = set()

    def visit(layer: nn.Module, name: str) -> None:
        seen.add(id(layer))
        why = kept_because(layer, name)
        report.add(name, layer, why)
        if why is None:
            _convert_in_place(layer, name)

    if is_layer(module):
        visit(module, "")
    for name, parent in list(module.named_modules(remove_duplicate=False)):
        # _modules, not named_children(), which would hide the second entry of a layer.
        for child_name, child in list(parent._modules.items()):
            if child is None or not is_layer(child) or id(child) in seen:
                continue
            visit(child, f"{name}.{child_name}" if name else child_name)
    report.log()
    if head_by_default and report.head:
        _log_head(report.head, recipe)
    # Mixture-of-experts: transformers 5 experts modules (3-D expert parameters).
    report.experts = convert_experts(module, module_filter_fn, recipe)
    report.warn(module)
    _validate_loads(module)
    if recipe is not None:
        for layer in module.modules():
            if isinstance(layer, Linear):
                layer.prepare_state(recipe)
    if quantized_all_gather:
        _quantize_all_gathers(module, recipe)
    wrap_forward(module, forward)  # autocast=...
    return module


def _layer_count(module: nn.Module) -> int:
    """How many ``nn.Linear`` (or transformers ``Conv1D``) layers ``module`` holds, itself
    included, each once (as ``keep_high_precision`` counts them)."""
    hf_conv1d = _hf_conv1d_class()
    return sum(
        isinstance(m, nn.Linear) or bool(hf_conv1d and isinstance(m, hf_conv1d))
        for m in module.modules()
    )


# Whether a conversion has logged its default-kept head at WARNING (once per process).
_head_warned = False


def _log_head(name: str, recipe: Recipe | None) -> None:
    """Say that ``recipe``'s default kept the output head ``name`` in high precision, and
    how to convert it: a WARNING the first time, INFO after."""
    global _head_warned  # noqa: PLW0603 - once per process
    level = logging.INFO if _head_warned else logging.WARNING
    _head_warned = True
    logger.log(
        level,
        "fastcast.convert: %s keeps the output head %r in high precision by default (its "
        "rounding errors reach the loss unaveraged; docs/usage.md); "
        "fc.convert(model, recipe=..., keep_head=False) converts it too",
        type(recipe).__name__,
        name,
    )


def _quantize_all_gathers(module: nn.Module, recipe: Recipe) -> None:
    # fastcast.distributed.fsdp imports torch.distributed: only when asked for.
    from ..distributed.fsdp import enable_quantized_all_gather  # noqa: PLC0415

    layers = [m for m in module.modules() if isinstance(m, Linear)]
    enable_quantized_all_gather(layers, recipe)


def keep_high_precision(
    module: nn.Module, *, first: int = 0, last: int = 1, names: Sequence[str] = ()
) -> Callable[[nn.Module, str], bool]:
    """A ``module_filter_fn`` for ``convert`` that keeps chosen layers of ``module`` in
    high precision: the first ``first`` and the last ``last`` ``nn.Linear`` (or
    transformers ``Conv1D``) layers below it (in registration order, a shared layer
    counted once), and every layer whose
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
    hf_conv1d = _hf_conv1d_class()
    order: list[int] = []
    for layer in module.modules():  # each module once, in registration order
        if isinstance(layer, nn.Linear) or (hf_conv1d and isinstance(layer, hf_conv1d)):
            order.append(id(layer))
    kept = set(order[:first]) | set(order[len(order) - last :] if last else ())
    prefixes = tuple(f"{n}." for n in names)

    def convert_it(layer: nn.Module, name: str) -> bool:
        return id(layer) not in kept and name not in names and not name.startswith(prefixes)

    return convert_it


def _validate_loads(module: nn.Module) -> None:
    """Install the load pre-hooks on ``module`` once: ``fill_tied_keys`` and
    ``validate_extra_states`` (an ``fc.Linear`` validates its own state, ties nothing)."""
    if isinstance(module, Linear):
        return
    installed = {getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()}
    if fill_tied_keys not in installed:  # first, so the validation sees the filled keys
        module.register_load_state_dict_pre_hook(fill_tied_keys)
    guard_loads(module)


def fill_tied_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load pre-hook (``fc.convert`` installs it on the model): a tensor reachable under
    several keys (tied parameters, a layer registered twice) that ``state_dict`` has under
    some of them only gets the others too, the same value.

    Savers that know about ties write such a tensor once: Hugging Face's
    ``save_pretrained`` leaves ``lm_head.weight`` out of GPT-2 and tied Llamas, so a
    strict ``load_state_dict`` of the file would report it missing, though loading it
    under the kept key already sets it. Keys present are never changed."""
    root = prefix[:-1] if prefix.endswith(".") else prefix
    groups: dict[int, list[str]] = {}
    named = (
        module.named_parameters(prefix=root, remove_duplicate=False),
        module.named_buffers(prefix=root, remove_duplicate=False),
    )
    for items in named:
        for name, tensor in items:
            if tensor is not None:
                groups.setdefault(id(tensor), []).append(name)
    # A layer registered under two names has its extra state under both.
    for name, sub in module.named_modules(prefix=root, remove_duplicate=False):
        if isinstance(sub, Linear):
            key = f"{name}.{EXTRA_STATE_KEY}" if name else EXTRA_STATE_KEY
            groups.setdefault(id(sub), []).append(key)
    for keys in groups.values():
        if len(keys) < 2:
            continue
        present = [k for k in keys if k in state_dict]
        if present and len(present) < len(keys):
            for key in keys:
                state_dict.setdefault(key, state_dict[present[0]])


def _convert_in_place(layer: nn.Module, name: str) -> Linear:
    """Make ``layer`` (an ``nn.Linear``, or transformers' ``Conv1D``) the fastcast module
    of its kind, keeping the object: its parameters, buffers, hooks, training flag and
    any attribute a user set on it stay, and references to it (the user's, a parent's, a
    tie) see the converted layer. Records its qualified name."""
    if type(layer) is nn.Linear:
        layer.__class__ = Linear
        layer._init_runtime()  # type: ignore[operator]
    else:
        adopt_hf_conv1d(layer)
    if name:
        layer._fc_name = name
    return layer  # type: ignore[return-value]


def _hf_conv1d_class() -> type | None:
    """transformers' ``Conv1D`` if a model has imported it (never imported here)."""
    hf = sys.modules.get(HF_MODULE)
    return None if hf is None else getattr(hf, "Conv1D", None)


def _features(layer: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    return layer.nx, layer.nf  # type: ignore[return-value]


def _kind(layer: nn.Module) -> str:
    if isinstance(layer, Conv1D) or not isinstance(layer, nn.Linear):
        return "Conv1D"
    return "nn.Linear"


# Why a layer was kept when the user's filter asked for it (not a reason to warn).
_FILTERED = "module_filter_fn returned False"
# Why the output head was kept (keep_head; not a reason to warn either).
_HEAD = "the output head, kept in high precision by keep_head"


class _Report:
    """What convert did, for the ``fastcast`` logger and the warnings."""

    def __init__(self) -> None:
        self.linear = 0
        self.conv1d = 0
        self.already = 0
        self.filtered = 0
        self.experts = 0  # experts modules on the grouped GEMM (converted now or before)
        self.skipped: list[str] = []
        self.head = ""  # the output head's name, when keep_head kept it

    @property
    def converted(self) -> int:
        return self.linear + self.conv1d

    def add(self, name: str, layer: nn.Module, why: str | None) -> None:
        shown = name or "<root>"
        if why is None:
            if type(layer) is nn.Linear:
                self.linear += 1
            else:
                self.conv1d += 1
        elif isinstance(layer, Linear):
            self.already += 1
        else:
            self.filtered += why in (_FILTERED, _HEAD)
            self.skipped.append(f"{shown} ({why})")
            if why == _HEAD:
                self.head = shown
        in_features, out_features = _features(layer)
        logger.debug(
            "fastcast.convert: %s (%sin_features=%d, out_features=%d): %s",
            shown,
            "Conv1D, " if _kind(layer) == "Conv1D" else "",
            in_features,
            out_features,
            "converted" if why is None else f"kept, {why}",
        )

    def summary(self) -> str:
        line = f"converted {self.linear} nn.Linear layer(s) to fastcast.Linear"
        if self.conv1d:
            line += f" and {self.conv1d} Conv1D layer(s) to fastcast.Conv1D"
        line += f"; skipped {len(self.skipped)}"
        if self.skipped:
            named = self.skipped[:_NAMED_IN_SUMMARY]
            line += ": " + ", ".join(named)
            if len(self.skipped) > len(named):
                line += f", and {len(self.skipped) - len(named)} more (DEBUG lists them)"
        if self.already:
            line += f"; {self.already} already fastcast.Linear"
        return line

    def log(self) -> None:
        if logger.isEnabledFor(logging.INFO):
            logger.info("fastcast.convert: %s", self.summary())

    def warn(self, module: nn.Module) -> None:
        """One warning when nothing was converted, or when more layers were kept for
        their shapes or classes than were converted (the user's filter excepted)."""
        involuntary = len(self.skipped) - self.filtered
        if self.converted == 0 and self.already == 0 and self.filtered == 0:
            if involuntary:
                why = "every nn.Linear/Conv1D layer was kept"
            elif self.experts:  # only experts modules, now on the grouped GEMM
                return
            else:
                why = "it has no nn.Linear or transformers Conv1D layer"
            cause = f"converted no layer of {type(module).__name__}: {why}"
        elif involuntary > self.converted + self.already:
            cause = f"kept more layers of {type(module).__name__} than it converted"
        else:
            return
        warnings.warn(
            f"fastcast.convert {cause}; those run in full precision under fc.autocast "
            f"({self.summary()})",
            UserWarning,
            stacklevel=3,
        )
