"""Formats and recipes: pure, immutable data describing how to quantize.

Recipes are frozen, hashable and compare by value. Their repr and hash are computed
once, at construction, by the base class; subclasses only declare fields and checks.
Nothing here touches torch, so building a recipe costs a few microseconds.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any

from .formats import ELEMENT_MAX


class Format(enum.Enum):
    """Element formats of the forward and backward (gradient) tensors.

    ``HYBRID`` is E4M3 for the forward operands and E5M2 for the gradients.
    """

    E4M3 = ("e4m3", "e4m3")
    E5M2 = ("e5m2", "e5m2")
    HYBRID = ("e4m3", "e5m2")
    E2M1 = ("e2m1", "e2m1")

    def __init__(self, fwd: str, bwd: str) -> None:
        self.fwd = fwd
        self.bwd = bwd

    def for_role(self, role: str) -> str:
        """The element format of a GEMM operand role: gradients use the backward one."""
        return self.bwd if role == "grad_output" else self.fwd

    @property
    def max_fwd(self) -> float:
        """Largest finite magnitude of the forward element format."""
        return ELEMENT_MAX[self.fwd]

    @property
    def max_bwd(self) -> float:
        """Largest finite magnitude of the gradient element format."""
        return ELEMENT_MAX[self.bwd]

    def __repr__(self) -> str:
        return f"Format.{self.name}"


AMAX_COMPUTE_ALGOS = ("max", "most_recent")


class Recipe:
    """Base of all recipes: value semantics, a repr and a hash computed once."""

    __slots__ = ("_repr", "_hash", "_values")

    # Subclasses are frozen slotted dataclasses declared with repr=False, eq=False,
    # so that these three methods (not generated ones) are used.
    def __post_init__(self) -> None:
        self._check()  # may normalise fields (e.g. -0.0 to 0.0), so values come after
        names = [f.name for f in dataclasses.fields(self)]
        values = tuple(getattr(self, n) for n in names)
        for name, value in zip(names, values):
            try:
                hash(value)
            except TypeError:
                raise ValueError(
                    f"{type(self).__name__}.{name} must be hashable, got {type(value).__name__}"
                ) from None
        body = ", ".join(f"{n}={_field_repr(v)}" for n, v in zip(names, values))
        # The fields are frozen, so the derived values can be fixed now; these three
        # slots are declared by this class and never change after construction.
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_repr", f"{type(self).__name__}({body})")
        object.__setattr__(self, "_hash", hash((type(self), values)))

    def _check(self) -> None:
        """Raise ValueError for an invalid combination of fields (may normalise fields)."""

    def __repr__(self) -> str:
        return self._repr

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values == other._values  # type: ignore[attr-defined]

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    # Recipes hold only immutable values, so a copy is the object itself.
    def __copy__(self) -> Recipe:
        return self

    def __deepcopy__(self, memo: dict) -> Recipe:
        return self

    def __reduce__(self) -> tuple:
        names = [f.name for f in dataclasses.fields(self)]
        return (_rebuild_recipe, (type(self), dict(zip(names, self._values))))


def _rebuild_recipe(cls: type, kwargs: dict[str, Any]) -> Recipe:
    return cls(**kwargs)


def _field_repr(value: Any) -> str:
    if callable(value) and not isinstance(value, Format):
        # Qualified name plus identity: two different callables never share a repr.
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"<{name} at {id(value):#x}>"
    return repr(value)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _require_format(recipe: str, fmt: object, allowed: tuple[Format, ...]) -> None:
    _require(
        isinstance(fmt, Format) and fmt in allowed,
        f"{recipe}: fp8_format must be one of {', '.join(f.name for f in allowed)}, got {fmt!r}",
    )


def _require_bool(recipe: str, name: str, value: object) -> None:
    _require(isinstance(value, bool), f"{recipe}: {name} must be a bool, got {value!r}")


_frozen = dataclasses.dataclass(frozen=True, slots=True, repr=False, eq=False)

# The largest DelayedScaling margin: 2**-margin is then still a normal FP32 number (beyond,
# the scale underflows to zero, and from 1024 on ``2.0**margin`` overflows). Saved
# delayed-scaling states are held to the same bound when they load.
MAX_MARGIN = 126


@_frozen
class DelayedScaling(Recipe):
    """Per-tensor scale from a history of amaxes of previous steps.

    Each module records the amax of its input and weight (forward) and of its output
    gradient (backward) per step; the scale used at step k is
    ``fmt_max / amax / 2**margin`` with ``amax`` the ``amax_compute_algo`` of the last
    ``amax_history_len`` steps up to k-1 (``"max"``, ``"most_recent"``, or a callable
    taking the ``[L, n]`` history). ``scaling_factor_compute_algo(amax, scale, fmt_max,
    recipe)`` replaces the scale formula. ``reduce_amax`` all-reduces amaxes over the
    autocast's ``amax_reduction_group``.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable[[Any], Any] = "max"
    scaling_factor_compute_algo: Callable[..., Any] | None = None
    reduce_amax: bool = True

    def _check(self) -> None:
        name = "DelayedScaling"
        _require(
            isinstance(self.margin, int)
            and not isinstance(self.margin, bool)
            and 0 <= self.margin <= MAX_MARGIN,
            f"{name}: margin must be a non-negative int (at most {MAX_MARGIN}), "
            f"got {self.margin!r}",
        )
        _require_format(name, self.fp8_format, (Format.HYBRID, Format.E4M3))
        _require(
            isinstance(self.amax_history_len, int)
            and not isinstance(self.amax_history_len, bool)
            and self.amax_history_len >= 1,
            f"{name}: amax_history_len must be an int >= 1, got {self.amax_history_len!r}",
        )
        algo = self.amax_compute_algo
        _require(
            callable(algo) or algo in AMAX_COMPUTE_ALGOS,
            f"{name}: amax_compute_algo must be 'max', 'most_recent' or a callable, got {algo!r}",
        )
        sf = self.scaling_factor_compute_algo
        _require(
            sf is None or callable(sf),
            f"{name}: scaling_factor_compute_algo must be None or a callable, got {sf!r}",
        )
        _require_bool(name, "reduce_amax", self.reduce_amax)


@_frozen
class Float8CurrentScaling(Recipe):
    """Per-tensor scale computed from the tensor being quantized: ``fmt_max / amax``.

    ``use_power_2_scales`` rounds the scale down to a power of two (exact rescaling);
    ``amax_epsilon`` floors the amax, so near-zero tensors do not get huge scales.
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0

    def _check(self) -> None:
        name = "Float8CurrentScaling"
        _require_format(name, self.fp8_format, (Format.HYBRID, Format.E4M3))
        _require_bool(name, "use_power_2_scales", self.use_power_2_scales)
        eps = self.amax_epsilon
        _require(
            isinstance(eps, (int, float))
            and not isinstance(eps, bool)
            and math.isfinite(eps)
            and eps >= 0,
            f"{name}: amax_epsilon must be a finite number >= 0, got {eps!r}",
        )
        # 0, 0.0 and -0.0 are one value: store it one way so that the repr agrees too.
        object.__setattr__(self, "amax_epsilon", float(eps) + 0.0)


@_frozen
class Float8RowwiseScaling(Recipe):
    """One FP8 scale per row of each GEMM operand, along the dim the GEMM contracts.

    torchao's ``rowwise`` recipe (``Float8LinearConfig.from_recipe_name("rowwise")``), and
    with ``wgrad_high_precision=True`` its ``rowwise_with_gw_hp``. Each scale is
    ``fmt_max / amax(row)`` from the tensor itself (no state), rounded down to a power of
    two with ``use_power_2_scales`` (torchao's default: scaling is then exact and the
    scale never grows a value). For a layer ``y = x @ W.T`` (x ``[M, K]`` tokens, W
    ``[N, K]``):

    - forward: x per token (along K), W per output feature (along K);
    - dgrad ``dx = g @ W``: g per token (along N), W per input feature (along N);
    - wgrad ``dW = g.T @ x``: g per output feature and x per input feature, both along
      the tokens M (the transposed matrices, quantized on their own, not transposed
      row scales).

    ``wgrad_high_precision`` runs the wgrad GEMM in the forward's high precision on the
    unquantized ``g`` and ``x`` (torchao's ``rowwise_with_gw_hp``): a more accurate weight
    gradient, at the cost of keeping ``x`` itself (not an FP8 copy) for backward: 2 bytes
    per element in bf16 instead of 1, 4 in FP32. As in torchao, W is then scaled per
    tensor for dgrad, so no tensor needs scales along its first dim.

    ``fp8_format``: E4M3 for every operand, as torchao, or HYBRID (E5M2 gradients).
    Rows are scaled from the local shard's elements: no amax is reduced across ranks.
    """

    fp8_format: Format = Format.E4M3
    use_power_2_scales: bool = True
    wgrad_high_precision: bool = False

    def _check(self) -> None:
        name = "Float8RowwiseScaling"
        _require_format(name, self.fp8_format, (Format.E4M3, Format.HYBRID))
        _require_bool(name, "use_power_2_scales", self.use_power_2_scales)
        _require_bool(name, "wgrad_high_precision", self.wgrad_high_precision)


@_frozen
class Float8BlockScaling(Recipe):
    """One scale per 1x128 tile (dim 1) or 128x128 tile (dim 2).

    ``use_f32_scales=False`` (the default) rounds every scale to a power of two.
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    use_f32_scales: bool = False

    def _check(self) -> None:
        name = "Float8BlockScaling"
        _require_format(name, self.fp8_format, (Format.E4M3, Format.HYBRID))
        dims = {
            "x_block_scaling_dim": self.x_block_scaling_dim,
            "w_block_scaling_dim": self.w_block_scaling_dim,
            "grad_block_scaling_dim": self.grad_block_scaling_dim,
        }
        for field, dim in dims.items():
            _require(
                type(dim) is int and dim in (1, 2),
                f"{name}: {field} must be 1 (1x128 tiles) or 2 (128x128 tiles), got {dim!r}",
            )
        # Each GEMM needs at least one operand with 1D tiles.
        for gemm, a, b in (
            ("forward (x @ w)", "x_block_scaling_dim", "w_block_scaling_dim"),
            ("dgrad (grad @ w)", "grad_block_scaling_dim", "w_block_scaling_dim"),
            ("wgrad (grad^T @ x)", "grad_block_scaling_dim", "x_block_scaling_dim"),
        ):
            _require(
                not (dims[a] == 2 and dims[b] == 2),
                f"{name}: {a}=2 with {b}=2 makes the {gemm} GEMM 2D x 2D, which is not supported",
            )
        _require_bool(name, "use_f32_scales", self.use_f32_scales)


@_frozen
class MXFP8BlockScaling(Recipe):
    """OCP MX: 32 consecutive elements along K share one E8M0 (power-of-two) scale."""

    fp8_format: Format = Format.E4M3

    def _check(self) -> None:
        _require_format("MXFP8BlockScaling", self.fp8_format, (Format.E4M3, Format.HYBRID))


@_frozen
class NVFP4BlockScaling(Recipe):
    """NVFP4: 16-element E2M1 blocks with E4M3 block scales and an FP32 tensor scale.

    The defaults are TransformerEngine's NVFP4 recipe (its ``disable_*`` flags off):
    ``weight_2d_blocks`` quantizes weights in 16x16 tiles, so that the weight and its
    transpose share one quantization; ``stochastic_rounding`` rounds the gradients (not
    inputs or weights) stochastically; ``random_hadamard_transform`` applies a 16x16
    random Hadamard transform along the tokens to both operands of the weight-gradient
    GEMM (the column-wise layouts of input and gradient), with TE's fixed sign vector, or
    one drawn from ``rht_seed``; ``rht_round_to_input_dtype=True`` rounds the transformed
    values of bf16/fp16 inputs to that dtype before quantizing, as TransformerEngine does
    (bit for bit TE's codes and scales; the default keeps them FP32, which is closer to
    exact arithmetic). Each can be turned off; ``stochastic_rounding=False,
    random_hadamard_transform=False`` is fastcast's earlier NVFP4 recipe.

    ``fc.convert(model, recipe=NVFP4BlockScaling())`` keeps the output layer (an LM head)
    in high precision by default (``keep_head``); ``fc.keep_high_precision`` keeps more.
    docs/usage.md has the measured effect on tiny models, and what the rest costs.
    """

    fp4_format: Format = Format.E2M1
    weight_2d_blocks: bool = True
    stochastic_rounding: bool = True
    random_hadamard_transform: bool = True
    rht_seed: int | None = None
    rht_round_to_input_dtype: bool = False

    def _check(self) -> None:
        name = "NVFP4BlockScaling"
        _require(
            self.fp4_format is Format.E2M1,
            f"{name}: fp4_format must be Format.E2M1, got {self.fp4_format!r}",
        )
        _require_bool(name, "weight_2d_blocks", self.weight_2d_blocks)
        _require_bool(name, "stochastic_rounding", self.stochastic_rounding)
        _require_bool(name, "random_hadamard_transform", self.random_hadamard_transform)
        _require_bool(name, "rht_round_to_input_dtype", self.rht_round_to_input_dtype)
        seed = self.rht_seed
        _require(
            seed is None or (type(seed) is int and seed >= 0),
            f"{name}: rht_seed must be None (TransformerEngine's fixed signs) or an int >= 0, "
            f"got {seed!r}",
        )


@_frozen
class CustomRecipe(Recipe):
    """User-supplied quantizers: ``qfactory(role)`` returns a Quantizer for that role."""

    qfactory: Callable[[str], Any]

    def _check(self) -> None:
        _require(
            callable(self.qfactory),
            f"CustomRecipe: qfactory must be callable as qfactory(role), got {self.qfactory!r}",
        )
