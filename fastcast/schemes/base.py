"""What a recipe means: the scheme protocol, the plan a module runs, the registry.

A scheme is the one place that knows what a recipe type means; every consumer (layers,
parallelism, the FSDP2 gather, compile, checkpoints) asks it, and its quantizers
(``quantizers.base.Quantizer``), never a recipe class. Schemes register by recipe type
(``register_scheme``, the public extension point).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch

from ..quantizers.base import ROLES, Blocks, Quantizer, over_group_shards, scale_blocks
from ..recipe import Recipe
from ..runtime.hardware import default_device_type, gemm_backend
from ..runtime.state import AutocastFrame

# The FP8 tensor-core kernels need both GEMM dims of a weight to be multiples of 16.
DEFAULT_ALIGNMENT = 16


class Plan:
    """What a module runs under one (recipe, group): the quantizers of its three roles.

    Built by the scheme the first time a module meets the pair, reused while the pair
    stays (two identity tests per call). Stateless schemes use this class as it is; it is
    then also the per-call object handed to the autograd Function (``call`` returns it),
    whose hooks do nothing. Stateful schemes subclass it.
    """

    __slots__ = (
        "recipe",
        "group",
        "input_q",
        "weight_q",
        "grad_q",
        "row_alignment",
        "wgrad_high_precision",
        "sharding",
    )

    # Per-call attributes a stateful call may set; a stateless plan never replays.
    replayed_weight: ClassVar[None] = None

    def __init__(
        self,
        recipe: Recipe,
        group: Any,
        quantizers: tuple[Quantizer, Quantizer, Quantizer],
        row_alignment: int = 1,
        wgrad_high_precision: bool = False,
    ) -> None:
        self.recipe = recipe
        self.group = group
        self.input_q, self.weight_q, self.grad_q = quantizers
        # Scheme.row_alignment: what the module pads the input's token count to.
        self.row_alignment = row_alignment
        # Scheme.wgrad_high_precision: the wgrad GEMM takes the unquantized gradient and
        # input (the input quantizer then makes no column-wise layout).
        self.wgrad_high_precision = wgrad_high_precision
        # The tensor-parallel sharding the quantizers were made for (None: the whole
        # tensors); set by ``nn.function.plan_for``, which keeps a plan while it stays.
        self.sharding: Any = None

    def matches(self, frame: AutocastFrame) -> bool:
        """Whether this plan is still the one for ``frame`` (in this thread)."""
        return frame.recipe is self.recipe and frame.group is self.group

    def call(self, autograd: bool, replay: Any = None, record: Any = None) -> Any:
        """The per-call object: quantizers plus hooks. Stateless: the plan itself.

        Under activation checkpointing ``record`` is the log entry ``[frame, data]`` of an
        original call, whose ``data`` a stateful scheme fills with what a recomputation
        must reuse, and ``replay`` such an entry for the recomputation of that call.
        Stateless quantization depends only on its input, so it replays by itself.
        """
        return self

    # -- per-call hooks (no-ops when stateless) --------------------------------------------
    def remember_weight(self, w_q: Any) -> Any:
        """Called with the quantized weight a forward used; returns it."""
        return w_q

    def forward_done(self) -> None:
        """Called after the forward GEMM."""

    def backward_done(self) -> None:
        """Called at the end of the module's backward."""

    def calibrate(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """A high-precision forward under ``calibrating=True``: record what state needs."""


class ModuleState(Protocol):
    """One value of a module's per-module scheme state (``module_state``: key -> value,
    kept by the module, made by ``Scheme.prepare``/``Scheme.plan``). Delayed scaling's
    is ``ScalingMeta``. The module handles it only through this protocol and the
    functions below.

    A stateful scheme also says how its state is saved: a ``StateFormat`` registered for
    its value type (``fastcast.serialization.state_format``) encodes a module's state into
    the extra-state tensor and loads it back, validated; the codec knows nothing else of
    it (delayed scaling's: ``schemes/delayed/saved_state.py``). State without a format is
    refused when saved, never dropped."""

    @property
    def device(self) -> torch.device:
        """Where its tensors are."""
        ...

    def move_to(self, device: torch.device) -> None:
        """Carry its values to ``device`` (the module's weight moved)."""
        ...

    def reset(self) -> None:
        """Start afresh, in place (the module's weights were replaced)."""
        ...


def follow_device(module_state: dict[Any, ModuleState], device: torch.device) -> None:
    """Move ``module_state`` to ``device`` (a module's weight's). Not to the meta device,
    which would lose its values (``to_empty`` materialises the weight later)."""
    if device.type == "meta":
        return
    for value in module_state.values():
        if value.device != device:
            value.move_to(device)


def reset_module_state(module_state: dict[Any, ModuleState]) -> None:
    """Reset every value of ``module_state`` in place."""
    for value in module_state.values():
        value.reset()


class Scheme:
    """The meaning of one recipe type. Subclasses set ``family`` and ``quantizer``;
    stateful ones set ``stateful`` and override ``plan`` (and ``sharded_plan``,
    ``state_weight_quantizer``, ``traced_quantizers``) too.

    What a scheme answers, each with a default that fits a stateless scheme whose
    quantizers say what they are (``Quantizer``'s optional attributes):

    - ``family``, ``support``: which GEMM family and hardware capability it needs;
    - ``alignment``, ``row_alignment``: what a layer's features and token count must be
      multiples of; ``keeps_head``, ``wgrad_high_precision``;
    - ``quantizer(s)``: a quantizer per role (input, weight, grad_output), activation and
      gradient amaxes reduced over the autocast's group where the scheme needs it;
    - ``scale_blocks(recipe, role)``: the block geometry of a role's two layouts along
      each dim (what parallel layers and the FSDP2 gather check shards against);
    - ``sharded_plan``: the plan for a layer whose tensors are split across a group
      (tensor parallelism: scales that span the split are reduced over it);
    - ``grouped_quantizers``: the quantizers of grouped (mixture-of-experts) GEMMs;
    - ``stateful``, ``prepare``, ``plan``: per-module state (saved through its
      ``StateFormat``); ``weight_format``; ``state_weight_quantizer``: a stateful
      scheme's weight quantizer from the module's state; ``traced_quantizers``: its
      quantizers in compiled code.
    """

    # The GEMM family (``tensor.FAMILIES``); None: the quantizers decide, GEMM by GEMM.
    family: ClassVar[str | None] = None

    # Whether plans keep per-module state (amax histories): the scheme overrides ``plan``.
    stateful: ClassVar[bool] = False

    def alignment(self, recipe: Recipe) -> int:
        """What a layer's in and out features must be multiples of to be converted."""
        return DEFAULT_ALIGNMENT

    def row_alignment(self, recipe: Recipe) -> int:
        """What the row count of a layer's ``[R, K]`` input (the product of its leading
        dims, the tokens) must be a multiple of for the backward GEMMs' column-wise
        layouts; ``fc.Linear`` pads the input with zero rows up to it. 1: any count."""
        return 1

    def keeps_head(self, recipe: Recipe) -> bool:
        """Whether ``fc.convert(model, recipe=recipe)`` keeps the model's output head (its
        last layer, as ``fc.keep_high_precision`` counts) in high precision unless told
        otherwise (``keep_head=False``)."""
        return False

    def wgrad_high_precision(self, recipe: Recipe) -> bool:
        """Whether the weight-gradient GEMM runs in the forward's high precision, on the
        unquantized output gradient and input (which backward then keeps), rather than on
        their column-wise quantized layouts."""
        return False

    def quantizer(self, recipe: Recipe, role: str, group: Any = None) -> Quantizer:
        """The quantizer for ``role`` (input, weight or grad_output); ``group`` reduces
        activation and gradient amaxes over ranks where the scheme needs it."""
        raise NotImplementedError

    def quantizers(self, recipe: Recipe, group: Any = None) -> tuple[Quantizer, ...]:
        """``(input, weight, grad_output)`` quantizers."""
        return tuple(self.quantizer(recipe, role, group) for role in ROLES)

    def scale_blocks(self, recipe: Recipe, role: str) -> Blocks | None:
        """``(block, block_t)`` of ``role``'s layouts (``Quantizer.scale_blocks``); None
        where the quantizer does not say."""
        return scale_blocks(self.quantizer(recipe, role))

    def sharded_plan(
        self,
        frame: AutocastFrame,
        module_state: dict[Any, ModuleState],
        device: torch.device,
        splits: dict[str, int],
        group: Any,
    ) -> Plan:
        """The plan of a layer whose role tensors are split across ``group`` along
        ``splits[role]`` (a dim of their ``[R, K]`` view; a role not in ``splits`` is
        whole on every rank): each split role's quantizer ``over_shards`` an all-reduce
        max over ``group``, so that every rank casts its shard as one process casts the
        whole tensor (tensor parallelism)."""
        recipe = frame.recipe
        quantizers = tuple(
            over_group_shards(q, group, splits[role]) if role in splits else q
            for role, q in zip(ROLES, self.quantizers(recipe, frame.group))
        )
        return Plan(
            recipe,
            frame.group,
            quantizers,
            self.row_alignment(recipe),
            self.wgrad_high_precision(recipe),
        )

    def weight_format(self, recipe: Recipe) -> str:
        """The element format of ``recipe``'s weights."""
        return self.quantizer(recipe, "weight").fmt

    def state_weight_quantizer(
        self, recipe: Recipe, module_state: dict[Any, ModuleState]
    ) -> Quantizer:
        """A stateful scheme's weight quantizer outside its autocast: the module's
        current weight scale, recording nothing (the FSDP2 gather of an evaluation)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no per-module state")

    def traced_quantizers(
        self,
        recipe: Recipe,
        module_state: dict[Any, ModuleState],
        read: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[Quantizer, Quantizer, Quantizer] | None:
        """A stateful scheme's quantizers in compiled code, reading their state through
        ``read``; None: it does not run compiled."""
        return None

    def grouped_quantizers(self, recipe: Recipe) -> tuple[Quantizer, ...]:
        """``(input, weight, grad_output)`` quantizers of grouped (mixture-of-experts)
        GEMMs, which quantize each token group and each expert as a tensor of its own
        (``quantizers.groups.quantize_groups``); a TypeError says why ``recipe`` has none."""
        return self.quantizers(recipe)

    def prepare(
        self, recipe: Recipe, module_state: dict[Any, ModuleState], device: torch.device
    ) -> None:
        """Create the per-module state ``recipe`` keeps (none when stateless), before the
        module first runs: a freshly built model then has the state-dict layout a trained
        one saves, which loaders that fill tensors in place (DCP) need."""

    def plan(
        self, frame: AutocastFrame, module_state: dict[Any, ModuleState], device: torch.device
    ) -> Plan:
        """A module's plan for ``frame``; stateful schemes keep per-module state in
        ``module_state`` (the module's, values following ``ModuleState``, saved by the
        ``StateFormat`` registered for their type)."""
        recipe = frame.recipe
        quantizers = self.quantizers(recipe, frame.group)
        return Plan(
            recipe,
            frame.group,
            quantizers,
            self.row_alignment(recipe),
            self.wgrad_high_precision(recipe),
        )

    def support(self, device_type: str) -> tuple[bool, str]:
        """Whether recipes of this scheme can run on ``device_type``, and how (or why not)."""
        if self.family is None:
            return True, "its quantizers decide"
        backend, reason = gemm_backend(device_type, self.family)
        return backend is not None, reason


_SCHEMES: dict[type, Scheme] = {}


def register_scheme(recipe_type: type[Recipe]) -> Any:
    """Class decorator: the decorated Scheme gives recipes of ``recipe_type`` meaning."""

    def register(cls: type[Scheme]) -> type[Scheme]:
        if not (isinstance(recipe_type, type) and issubclass(recipe_type, Recipe)):
            raise TypeError(f"register_scheme needs a Recipe subclass, got {recipe_type!r}")
        if recipe_type in _SCHEMES and type(_SCHEMES[recipe_type]) is not cls:
            raise ValueError(
                f"{recipe_type.__name__} already has the scheme "
                f"{type(_SCHEMES[recipe_type]).__name__}"
            )
        _SCHEMES[recipe_type] = cls()
        return cls

    return register


def scheme_for(recipe: object) -> Scheme:
    """The scheme of ``recipe``'s type; TypeError for anything that is not a recipe."""
    scheme = _SCHEMES.get(type(recipe))
    if scheme is not None:
        return scheme
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a fastcast recipe, got {type(recipe).__name__}")
    for base in type(recipe).__mro__[1:]:  # a subclass of a registered recipe
        if base in _SCHEMES:
            return _SCHEMES[base]
    raise TypeError(
        f"no scheme is registered for {type(recipe).__name__}; "
        "decorate one with fastcast.schemes.register_scheme"
    )


def recipe_support(recipe: Recipe, device_type: str | None = None) -> tuple[bool, str]:
    """Whether ``recipe`` can run on this machine (or ``device_type``), and how (or why not)."""
    return scheme_for(recipe).support(device_type or default_device_type())
