"""``fc.Linear``: ``nn.Linear`` whose GEMMs run in FP8/FP4 inside ``fc.autocast``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import is_dtensor
from ..profiling import annotate
from ..quantizers.base import check_input
from ..recipe import Recipe
from ..runtime import state as _state
from ..runtime.state import OUTSIDE, AutocastFrame, get_stack, mark_ran
from ..schemes import ModuleState, Plan, follow_device, reset_module_state, scheme_for
from ..serialization.extra_state import (
    EXTRA_STATE_KEY,
    decode_extra_state,
    encode_extra_state,
    legacy_pickled_state,
)
from .function import LinearFunction, forward_gemm
from .recompute import RecomputeLog, checkpoint_region
from .weight_cache import WeightCache


class Linear(nn.Linear):
    """Drop-in for ``nn.Linear``: same constructor, parameters and state-dict keys. Only a
    layer that keeps per-module state (DelayedScaling's amax histories and scales: after
    it ran under that recipe, or once ``fc.convert(..., recipe=fc.DelayedScaling())``
    prepared them) adds ``_extra_state``, one small float32 tensor
    (``fastcast.serialization.extra_state`` has its layout); under any other recipe, or
    none, its state dict is exactly ``nn.Linear``'s (``_load_from_state_dict`` says what
    loading a checkpoint of the other kind does).

    Outside ``fc.autocast`` (or with ``enabled=False``) it computes exactly what
    ``nn.Linear`` does. Inside, forward, dgrad and wgrad GEMMs take quantized operands
    (``recipe`` decides the formats); the bias is added in FP32, and the output has the
    input's dtype, or ``torch.autocast``'s when that is active too. Dtypes follow
    ``nn.Linear``'s rules: input, weight and bias must share one unless ``torch.autocast``
    is on for the input's device. Any number of tokens (leading dims) works: where a
    recipe's backward needs the token count to be a multiple of its block (32 for MXFP8,
    16 for NVFP4), the input is padded with zero rows, and the padding never reaches the
    output or the gradients. Errors raised in a quantized forward name the layer (its
    qualified name when ``fc.convert`` made it).

    It subclasses ``nn.Linear``, as torchao's ``Float8Linear`` does, so that code testing
    ``isinstance(m, nn.Linear)`` (weight initialisation in Hugging Face models, PEFT/LoRA
    wrapping, parallelisation plans) keeps treating it as a linear layer; code that tests
    ``type(m) is nn.Linear`` (``fc.convert`` itself) does not. Code that reads ``m.weight``
    and calls ``F.linear`` itself, as ``nn.MultiheadAttention`` does with its output
    projection, bypasses the quantized GEMMs, as it would bypass any ``forward``.

    ``forward(x, is_first_microbatch=None)``: ``True`` quantizes the weight and keeps
    it, ``False`` reuses the kept one for the following micro-batches of the step; the
    kept weight is dropped as soon as the weight changes (its version counter moves, or
    any optimizer steps: fused optimizers leave the version counter alone), or another
    weight object is set (FSDP2 does at every gather and reshard: the weight is kept
    across micro-batches while FSDP2 keeps it gathered).
    """

    # Qualified name in the model fc.convert swapped this layer into (error messages).
    _fc_name: str | None = None
    # Whether the weight parameter is stored [in, out] (fc.Conv1D): the GEMMs take its
    # transposed view, so the numerics are those of a Linear with that weight.
    _fc_transposed: bool = False
    # The stateless recipe this layer was prepared for (``prepare_state``, which
    # ``fc.convert(..., recipe=...)`` calls), by name: a checkpoint's delayed-scaling state
    # is then refused (strict) or dropped, not taken. None: no stateless recipe declared.
    _fc_stateless_for: str | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        # nn.Linear's parameters and initialisation (reset_parameters), then our runtime.
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_runtime()

    def _init_runtime(self) -> None:
        # Runtime-only state: rebuilt after pickling, never part of the state dict.
        self._plan: Plan | None = None
        self._weight_cache = WeightCache()
        # Per-module state of stateful schemes (schemes.base.ModuleState values; delayed
        # scaling keeps one per direction), saved in the extra state.
        self._scheme_state: dict[Any, ModuleState] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":
            # Another weight object: the kept quantized weight is not its. (FSDP2 swaps
            # the gathered weight in before a forward and the sharded one back after;
            # each gather writes the unsharded weight keeping its version counter, often
            # into the same memory, so the cache's own test cannot see the new values.
            # FSDP2 swaps with setattr on a module that defines __setattr__.)
            cache = self.__dict__.get("_weight_cache")
            if cache is not None and value is not self._parameters.get("weight"):
                cache.clear()
        super().__setattr__(name, value)

    def _get_name(self) -> str:
        # What repr prints: fastcast.Linear(in_features=.., out_features=.., bias=..).
        return "fastcast.Linear"

    # -- the hot path ---------------------------------------------------------------------
    @annotate("fastcast.Linear.forward", instance_name="_fc_name")
    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        frame = get_stack()[0]
        params = self._parameters  # direct: nn.Module.__getattr__ is a slow fallback
        weight, bias = params["weight"], params["bias"]
        if self._fc_transposed:  # fc.Conv1D keeps its weight as [in, out]
            weight = weight.t()
        replay = record = None
        region = checkpoint_region(frame.active)
        if region is not None:  # activation checkpointing: record, or replay the original
            frame, replay, record = self._checkpointed(frame, *region)
        if not frame.enabled:
            if x.__class__ is not torch.Tensor and is_dtensor(x):
                # QuantizedColwiseParallel leaves a sequence-sharded input to the layer,
                # which gathers it, in high precision here (as ColwiseParallel would).
                x = _tensor_parallel().replicated_input(x, weight)
            if frame.calibrating and replay is None:
                self._calibrate(x, weight, frame)
            return F.linear(x, weight, bias)
        mark_ran(frame)  # fc.autocast warns at exit when no layer ran in it

        # Errors below name the layer (see _where); the try costs nothing when none is raised.
        try:
            _check_features(x, self.in_features)
            if x.dtype is not weight.dtype or (bias is not None and bias.dtype is not weight.dtype):
                _check_dtypes(x, weight, bias)
            if x.numel() == 0:  # nothing to quantize (an MoE expert without tokens, say)
                return F.linear(x, weight, bias)
            if weight.__class__ is not nn.Parameter and is_dtensor(weight):
                # Tensor parallel (parallelize_module): GEMMs on the local shards.
                return _tensor_parallel().linear_forward(
                    self, x, weight, bias, frame, is_first_microbatch, replay, record
                )
            plan = plan_for(self, frame, weight)
            autograd = torch.is_grad_enabled() and (
                x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
            )
            call = plan.call(autograd, replay, record)
            cache = self._weight_cache
            if not autograd:
                return forward_gemm(
                    x, weight, bias, call, cache, is_first_microbatch, False, False
                )[0]
            rows = x.numel() // self.in_features
            if rows % plan.row_alignment and weight.requires_grad:
                return _padded(
                    x, rows, plan.row_alignment, weight, bias, call, cache, is_first_microbatch
                )
            return LinearFunction.apply(x, weight, bias, call, cache, is_first_microbatch)
        except _NAMED as exc:
            if type(exc) in _NAMED:  # subclasses (out of memory, say) pass through as they are
                raise type(exc)(f"{self._where()}: {exc}") from exc
            raise

    def _where(self, key: str | None = None) -> str:
        """The layer, for error messages: its name in the model fc.convert saw, if any,
        and the state-dict ``key`` being loaded."""
        features = f"in_features={self.in_features}, out_features={self.out_features}"
        name = self._fc_name
        where = f"fc.Linear {name!r} ({features})" if name else f"fc.Linear({features})"
        return where if key is None else f"{where} at {key!r}"

    def _checkpointed(
        self, frame: AutocastFrame, log: RecomputeLog, recomputing: bool
    ) -> tuple[AutocastFrame, Any, Any]:
        """``(frame, replay, record)`` for a call inside a checkpointed region: the
        recomputation runs under the original call's frame and replays its entry (a call
        that recorded nothing ran in high precision); an original call records one."""
        if recomputing:
            entry = log.replay(self)
            return (OUTSIDE, None, None) if entry is None else (entry[0], entry, None)
        return frame, None, (log.record(self, frame) if frame.active else None)

    def _calibrate(self, x: torch.Tensor, weight: torch.Tensor, frame: AutocastFrame) -> None:
        """High-precision run that lets stateful schemes record what they need."""
        if weight.__class__ is not nn.Parameter and is_dtensor(weight):
            _tensor_parallel().calibrate(self, x, weight, frame)
            return
        plan_for(self, frame, weight).calibrate(x, weight)

    # -- state: _extra_state, loading, device moves, pickling -------------------------------
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

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:
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
        if isinstance(sub, Linear) and sub is not module:
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


def _load_plan(layer: Linear, state_dict: Any, prefix: str) -> tuple[str, dict[Any, Any]]:
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


def warn_conversions(planned: list[tuple[Linear, str, str]]) -> None:
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
    if isinstance(module, Linear):
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


def plan_for(module: Linear, frame: AutocastFrame, weight: torch.Tensor) -> Plan:
    """``module``'s plan for the frame's (recipe, group), rebuilt only when it changes.

    (A function, not a method, so that ``fastcast.compile`` can give compiled code its own.)
    """
    plan = module._plan
    if plan is None or not plan.matches(frame):
        if frame.group is not None:  # the amaxes are reduced: ranks must agree on the recipe
            _agreement().agree(frame.recipe, weight.device, "the amax reduction", frame.group)
        scheme = scheme_for(frame.recipe)
        plan = module._plan = scheme.plan(frame, module._scheme_state, weight.device)
    observer = _state.layer_observer  # fc.inspect's observer point (None: nothing to call)
    if observer is not None:
        return observer(module, frame, plan)
    return plan


# Exceptions forward re-raises with the layer's name in front (exact types only).
_NAMED = (ValueError, TypeError, RuntimeError)


def _check_features(x: torch.Tensor, in_features: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != in_features:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"expects input [..., {in_features}], got {shape}")
    check_input(x)


def _check_dtypes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """nn.Linear's rule for dtypes that differ: fine under torch.autocast for the input's
    device type (which casts them), a RuntimeError otherwise."""
    if torch.is_autocast_enabled(x.device.type):
        return
    if x.dtype is not weight.dtype:
        raise RuntimeError(
            f"mat1 and mat2 must have the same dtype, but got {x.dtype} (input) and "
            f"{weight.dtype} (weight), as nn.Linear requires outside torch.autocast"
        )
    raise RuntimeError(
        f"bias and weight must have the same dtype, but got {bias.dtype} (bias) and "
        f"{weight.dtype} (weight), as nn.Linear requires outside torch.autocast"
    )


def _padded(
    x: torch.Tensor,
    rows: int,
    align: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    call: Any,
    cache: WeightCache,
    first: bool | None,
) -> torch.Tensor:
    """LinearFunction over ``x``'s ``[R, K]`` rows padded with zero rows to a multiple of
    ``align`` (the column-wise blocks of the weight gradient run along R), sliced back.

    Autograd does the rest: the sliced-off rows get zero gradients and the pad's backward
    drops their input gradients; zero rows in both the input and the gradient add nothing
    to the weight gradient, nor to the bias gradient.
    """
    x2d = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % align))
    out = LinearFunction.apply(x2d, weight, bias, call, cache, first)[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


def _agreement() -> Any:
    """``distributed.agreement``, imported on first use (it needs torch.distributed)."""
    from ..distributed import agreement  # noqa: PLC0415

    return agreement


def _tensor_parallel() -> Any:
    """``nn.tensor_parallel``, imported on first use (it needs DTensor)."""
    from . import tensor_parallel  # noqa: PLC0415 - torch.distributed.tensor

    return tensor_parallel
