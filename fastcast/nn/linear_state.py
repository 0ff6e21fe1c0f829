"""``fc.Linear``'s state: its extra state, checkpoint loads, device moves and pickling.

Invariant: a load decides what it does with every layer's extra state before the first
parameter is written, so a refused load leaves the model as it was.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..recipe import Recipe
from ..schemes import follow_device, reset_module_state, scheme_for
from ..serialization.extra_state import (
    EXTRA_STATE_KEY,
    decode_extra_state,
    encode_extra_state,
    legacy_pickled_state,
)


class LinearState:
    """The state methods of ``fc.Linear`` (a base class of it, before ``nn.Linear``): they
    use its ``_scheme_state``, ``_plan``, ``_weight_cache``, ``_where`` and
    ``_init_runtime``."""

    _scheme_state: dict[Any, Any]
    # The stateless recipe this layer was prepared for (``prepare_state``, which
    # ``fc.convert(..., recipe=...)`` calls), by name: a checkpoint's delayed-scaling state
    # is then refused (strict) or dropped, not taken. None: no stateless recipe declared.
    _fc_stateless_for: str | None = None

    def prepare_state(self, recipe: Recipe) -> None:
        """Create the state ``recipe`` keeps per module (delayed scaling: fresh amax
        histories and scales) now rather than at the first forward, so that this module's
        state dict already has the layout a trained one saves (DCP loads in place and
        needs it). ``fc.convert(..., recipe=...)`` calls this; stateless recipes keep
        nothing, and the layer then refuses a checkpoint's delayed-scaling state (see
        ``_load_from_state_dict``). State the module already has is left as it is."""
        device = self.weight.device
        if device.type == "meta":  # materialised later by to_empty(), which _apply follows
            device = torch.device("cpu")
        scheme_for(recipe).prepare(recipe, self._scheme_state, device)
        self._fc_stateless_for = None if self._scheme_state else type(recipe).__name__

    def get_extra_state(self) -> torch.Tensor:
        """A 1-D float32 CPU tensor (layout: ``fastcast.serialization.extra_state``): the
        16-value stateless header when the module keeps no state (which ``state_dict``
        then leaves out)."""
        return encode_extra_state(self._scheme_state)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self._scheme_state:
            # Nothing to save: the state dict is nn.Linear's, so plain loaders (Hugging
            # Face's from_pretrained, serving stacks) see only the keys they know.
            del destination[prefix + EXTRA_STATE_KEY]

    def set_extra_state(self, state: Any) -> None:
        # In a load, _load_from_state_dict (or the model's pre-hook) has decoded the state
        # and decided what to do with it (_load_plan): only a state to install is taken.
        # Any other call decodes it here.
        pending = self.__dict__.pop("_fc_pending", None)
        if pending is not None and pending[1] is state:
            if pending[2] != _INSTALL:
                return
            scheme_state = pending[3]
        else:
            scheme_state = decode_extra_state(state, owner=self._where())
        # The old state is simply dropped (delayed scaling's slabs hold members weakly and
        # compact dead columns at their next update; leaving each slab now would rebuild
        # it per module).
        follow_device(scheme_state, self._parameters["weight"].device)
        # Plain attributes: __dict__ directly, as nn.Module.__setattr__ would (faster).
        self.__dict__.update(_scheme_state=scheme_state, _plan=None)
        self._weight_cache.clear()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """What a load does with this layer's ``_extra_state`` (``_load_plan`` decides):

        - a saved state (DelayedScaling's) is installed, unless the layer was prepared
          for a stateless recipe (``fc.convert(..., recipe=...)``): its state dict has no
          such key, so the entry is an unexpected key, as for ``nn.Linear`` (torch's
          error with ``strict=True``; dropped with ``strict=False``), with a warning
          saying why and what to do;
        - no entry, or the stateless header an earlier fastcast saved (it holds nothing):
          not a missing key, even with ``strict=True``; a layer holding state whose
          weight is loaded starts its scales afresh (new weights make the old scales
          meaningless), with a warning.

        Decided before nn.Module writes any parameter, so a refused state leaves the
        module as it was; the model's pre-hook (``validate_extra_states``) decides for
        every layer below it before the first parameter of the model is written."""
        key = prefix + EXTRA_STATE_KEY
        args = (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        present = key in state_dict
        state = state_dict[key] if present else None
        pending = self.__dict__.pop("_fc_pending", None)
        if pending is not None and pending[0] is missing_keys and pending[1] is state:
            action, decoded = pending[2], pending[3]  # the pre-hook's, in this load
        else:
            action, decoded = _load_plan(self, state_dict, prefix)
            warn_conversions([(self, key, action)])
        if present:  # nn.Module hands it to set_extra_state, which follows the plan
            self.__dict__["_fc_pending"] = (missing_keys, state, action, decoded)
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.__dict__.pop("_fc_pending", None)
        if not present and key in missing_keys:
            missing_keys.remove(key)
        if action == _DROP:
            unexpected_keys.append(key)
        elif action == _AFRESH:
            reset_module_state(self._scheme_state)
            self._weight_cache.clear()

    def _apply(self, fn: Any, recurse: bool = True) -> LinearState:
        super()._apply(fn, recurse)
        follow_device(self._scheme_state, self.weight.device)
        self._plan = None
        self._weight_cache.clear()
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Pickled as its extra-state tensor, under the key older versions used.
        state["_metas"] = self.get_extra_state()
        # Runtime-only: rebuilt by _init_runtime on unpickling.
        del state["_scheme_state"], state["_plan"], state["_weight_cache"]
        state.pop("_fc_pending", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        saved = legacy_pickled_state(state.pop("_metas", None))
        self.__dict__.update(state)
        self._init_runtime()
        self.set_extra_state(saved)


def validate_extra_states(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any = None,
    strict: bool = True,
    missing_keys: list[str] | None = None,
    *_: Any,
) -> None:
    """Load pre-hook of every module holding an ``fc.Linear`` (``guard_loads`` installs
    it): decode every ``fc.Linear`` extra state of ``state_dict`` below ``module`` and
    decide what the load does with it (``_load_plan``) before the first parameter is
    written, so that one refused state (a later layer's) leaves the whole model as it
    was; one warning per kind of conversion for the whole load. (torch calls load hooks
    with ``strict=True`` whatever the caller asked: strictness is applied to the missing
    and unexpected keys after the load.) Nested modules each have
    the hook: a layer that an outer module's hook planned in this same load
    (``missing_keys`` is the load's own list) is not planned again."""
    planned = []
    for name, sub in module.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
        if isinstance(sub, LinearState) and sub is not module:
            done = sub.__dict__.get("_fc_pending")
            if done is not None and missing_keys is not None and done[0] is missing_keys:
                continue
            sub_prefix = f"{name}." if name else ""
            key = sub_prefix + EXTRA_STATE_KEY
            state = state_dict[key] if key in state_dict else None
            action, decoded = _load_plan(sub, state_dict, sub_prefix)
            planned.append((sub, key, state, action, decoded))
    # All accepted: each module follows its plan when the load reaches it (if its state
    # is still the same object then), rather than deciding a second time.
    for sub, _key, state, action, decoded in planned:
        sub.__dict__["_fc_pending"] = (missing_keys, state, action, decoded)
    warn_conversions([(sub, key, action) for sub, key, _, action, _ in planned])


# What a load does with an fc.Linear's extra state (_load_plan).
_INSTALL = "install"  # the saved state replaces the layer's
_KEEP = "keep"  # nothing saved, and nothing to start afresh: the layer's state stays
_AFRESH = "afresh"  # nothing saved for a layer holding state, whose weight is loaded
_DROP = "drop"  # a saved state that a layer prepared for a stateless recipe leaves out


def _load_plan(layer: LinearState, state_dict: Any, prefix: str) -> tuple[str, dict[Any, Any]]:
    """``(action, decoded state)`` for ``layer``'s entry in ``state_dict`` (its keys start
    with ``prefix``); a ValueError naming the entry for a state that cannot be loaded.
    Changes nothing."""
    key = prefix + EXTRA_STATE_KEY
    decoded: dict[Any, Any] = {}
    if key in state_dict:
        decoded = decode_extra_state(state_dict[key], owner=layer._where(key))
    if decoded:  # the stateless header (earlier fastcast versions) decodes to nothing
        if layer._fc_stateless_for is None or layer._scheme_state:
            return _INSTALL, decoded
        return _DROP, decoded
    if layer._scheme_state and prefix + "weight" in state_dict:
        return _AFRESH, decoded
    return _KEEP, decoded


def warn_conversions(planned: list[tuple[LinearState, str, str]]) -> None:
    """One warning per conversion a load makes (``(layer, key, action)`` per layer, a
    layer registered twice counted once): scales started afresh, states dropped."""
    for action, what in (
        (
            _AFRESH,
            "the checkpoint holds no per-layer state for {n} fc.Linear layer(s) that keep "
            "one ({keys}): a plain checkpoint, or one saved under a stateless recipe; their "
            "DelayedScaling amax histories and scales start afresh",
        ),
        (
            _DROP,
            "the checkpoint holds DelayedScaling state (scales and amax histories) for {n} "
            "fc.Linear layer(s) converted for {recipe}, which keeps none ({keys}): their "
            "entries are unexpected keys (strict=True refuses the load, strict=False drops "
            "the state). To resume the scales, convert with recipe=fc.DelayedScaling(...); "
            "to drop them, load fc.strip_extra_state(state_dict)",
        ),
    ):
        seen: set[int] = set()
        keys, recipes = [], set()
        for layer, key, act in planned:
            if act == action and id(layer) not in seen:
                seen.add(id(layer))
                keys.append(repr(key))
                recipes.add(layer._fc_stateless_for)
        if keys:
            shown = ", ".join(keys[:3]) + (f", and {len(keys) - 3} more" if len(keys) > 3 else "")
            recipe = " or ".join(sorted(map(str, recipes)))
            warnings.warn(
                f"fastcast: {what.format(n=len(keys), keys=shown, recipe=recipe)} "
                "(docs/checkpoints.md)",
                UserWarning,
                stacklevel=2,
            )


def guard_loads(module: nn.Module) -> None:
    """Give ``module`` the ``validate_extra_states`` load pre-hook, once (an ``fc.Linear``
    validates its own state: it needs none)."""
    if not _guards_loads(module):
        module.register_load_state_dict_pre_hook(validate_extra_states)


def _guards_loads(module: nn.Module) -> bool:
    """Whether ``module`` is an ``fc.Linear`` or has the validating pre-hook (so holds one)."""
    if isinstance(module, LinearState):
        return True
    hooks = module._load_state_dict_pre_hooks.values()
    return any(getattr(h, "hook", h) is validate_extra_states for h in hooks)


def _on_registration(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """torch's global module-registration hook: a module that takes an ``fc.Linear``, or a
    module holding one, as a child gets the validating pre-hook. A model is built from
    the inside out (children first), so the hook climbs to its root as the model is put
    together: a refused load changes nothing whether the model was built from
    ``fc.Linear`` directly, converted by ``fc.convert`` (which guards the module it is
    given), or made by a library (Hugging Face models build their layers in
    ``__init__``). The one case left to the user: an ``fc.Linear`` assigned into a model
    already built guards its new parent only; ``fc.convert(model)`` then guards the
    whole model. Stateless, and it returns None (the child is kept)."""
    if child is not None and _guards_loads(child):
        guard_loads(parent)


# Installed once, when fc.Linear is defined; torch keeps it for the process.
torch.nn.modules.module.register_module_module_registration_hook(_on_registration)
