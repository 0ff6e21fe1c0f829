"""Delayed scaling storage: amax histories and scales, updated in batches.

What the recipe means is ``scheme.py`` beside it, and when updates happen ``owners.py``;
this module holds the tensors.

Every module keeps, per direction (forward: input and weight; backward: grad_output), a
``ScalingMeta``: an amax history ``[L, n]`` and scales ``[n]``. Once a module runs under
an autocast key, its meta's tensors become column views into that key's ``Slab``: one
contiguous history ``[L, N]`` and scale ``[N]`` for all N columns of all modules. The
update is then a fixed handful of tensor operations (and at most one ``all_reduce(MAX)``)
per slab, whatever the number of modules. Growing a slab re-points every member's views;
that happens when a module first runs under a key, not per step.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple

import torch

from ...formats import ELEMENT_MAX, FP32_MAX
from ...kernels import fused_op
from ...quantizers.reduction import all_reduce_max
from ...recipe import DelayedScaling
from ...reference.amax import delayed_update_reference
from ...reference.cast import min_scale, scale_from_amax

FORWARD, BACKWARD = 0, 1

# State made under torch.inference_mode would be an inference tensor that training could
# never update in place again: these buffers are always made as normal tensors.
_normal_tensors = torch.inference_mode(False)


class ScalingOrigin(NamedTuple):
    """The recipe fields a meta's scales were computed under (saved in checkpoints).

    None marks a field that is unknown (state from an older format or another library).
    """

    fmt: str | None  # element format of this direction: "e4m3" or "e5m2"
    margin: int | None
    amax_compute_algo: str | None  # "max", "most_recent" or "callable"
    custom_scale: bool | None  # a scaling_factor_compute_algo was set
    reduce_amax: bool | None

    @classmethod
    def of(cls, recipe: DelayedScaling, fmt: str) -> ScalingOrigin:
        algo = recipe.amax_compute_algo
        return cls(
            fmt,
            recipe.margin,
            algo if isinstance(algo, str) else "callable",
            recipe.scaling_factor_compute_algo is not None,
            recipe.reduce_amax,
        )

    def same_scales(self, other: ScalingOrigin) -> bool:
        """Whether scales made under ``self`` mean what they would under ``other``: the
        same format and margin, both known (a custom scale formula counts as known)."""
        return (
            self.fmt is not None
            and self.margin is not None
            and ((self.fmt, self.margin) == (other.fmt, other.margin))
        )


UNKNOWN_ORIGIN = ScalingOrigin(None, None, None, None, None)


class ScalingMeta:
    """Amax history and scales of one module for one direction (``n`` roles).

    History row 0 is the step being recorded; after an update rows 1..L-1 hold the
    previous steps' amaxes, oldest first (the update rolls the rows up by one).
    """

    __slots__ = (
        "n",
        "history",
        "scale",
        "scale_views",
        "amax_slots",
        "slab",
        "origin",
        "__weakref__",
    )

    @_normal_tensors
    def __init__(
        self,
        n: int,
        history_len: int,
        device: torch.device | str = "cpu",
        origin: ScalingOrigin = UNKNOWN_ORIGIN,
    ) -> None:
        self.n = n
        self.slab: Slab | None = None
        self.origin = origin
        self._own(
            torch.zeros(history_len, n, device=device),
            torch.ones(n, device=device),
        )

    @property
    def device(self) -> torch.device:
        """Where the history and scales are (``schemes.base.ModuleState``)."""
        return self.history.device

    def _own(self, history: torch.Tensor, scale: torch.Tensor) -> None:
        """Point at ``history``/``scale`` (standalone tensors or views into a slab)."""
        self.history = history
        self.scale = scale
        # One-element views per role, made once: the quantizers read and write these.
        self.scale_views = [scale[i : i + 1] for i in range(self.n)]
        self.amax_slots = [history[0, i : i + 1] for i in range(self.n)]

    @_normal_tensors
    def detach(self) -> None:
        """Leave the slab, keeping a private copy of the current values (a meta outside
        any slab already holds private tensors)."""
        if self.slab is not None:
            self.slab.remove(self)
            self._own(self.history.clone(), self.scale.clone())

    @_normal_tensors
    def move_to(self, device: torch.device) -> None:
        """Leave the slab and carry the values to ``device``."""
        self.detach()
        if self.history.device != device:
            self._own(self.history.to(device), self.scale.to(device))

    @classmethod
    @_normal_tensors
    def from_tensors(
        cls,
        history: torch.Tensor,
        scale: torch.Tensor,
        origin: ScalingOrigin = UNKNOWN_ORIGIN,
    ) -> ScalingMeta:
        """A meta holding copies of ``history`` ``[L, n]`` and ``scale`` ``[n]``, which
        must be finite, with amaxes >= 0 and scales > 0 (ValueError otherwise)."""
        check_scaling_tensors(history, scale)
        return cls.holding(history.float().clone(), scale.float().clone(), origin)

    @classmethod
    def holding(
        cls, history: torch.Tensor, scale: torch.Tensor, origin: ScalingOrigin
    ) -> ScalingMeta:
        """A meta that owns ``history`` and ``scale`` as they are (already checked and
        private to it: the caller gives them up)."""
        meta = cls.__new__(cls)
        meta.n = scale.shape[0]
        meta.slab = None
        meta.origin = origin
        meta._own(history, scale)
        return meta

    @_normal_tensors
    def reset(self) -> None:
        """Forget the history and scales (amaxes 0, scales 1), in place."""
        self.history.zero_()
        self.scale.fill_(1.0)

    @_normal_tensors
    def resize_history(self, history_len: int) -> None:
        """Change the history to ``history_len`` rows, keeping row 0 (the step being
        recorded) and the newest past rows that fit, still oldest first."""
        old = self.history
        if old.shape[0] == history_len:
            return
        new = torch.zeros(history_len, self.n, device=old.device)
        new[0] = old[0]
        past = min(history_len, old.shape[0]) - 1
        if past > 0:
            new[history_len - past :] = old[old.shape[0] - past :]
        self.detach()  # leaves this meta with a private copy of its scale
        self._own(new, self.scale)

    @_normal_tensors
    def adopt(self, recipe: DelayedScaling, fmt: str) -> None:
        """Make the scales mean what ``recipe`` means for ``fmt``; a scale made for another
        format (or margin) is never applied, since it is off by the ratio of their ranges
        (an e5m2 scale is 128x too large for e4m3).

        When the origin differs (or is unknown), each column's scale is recomputed from
        the largest amax of its history (conservative: nothing saturates that did not
        before). A column whose history holds no amax (``amax_history_len=1`` saves
        none: its only row is the step being recorded) is recomputed from the amax its
        scale stands for, ``fmt_max / scale / 2**margin`` under the origin's format and
        margin, when the origin is fully known and the scale came from fastcast's formula
        (no ``scaling_factor_compute_algo``) and is not the initial 1.0; otherwise it
        restarts at 1.0, the scale of a module that never ran. Then the origin is
        recorded."""
        origin = ScalingOrigin.of(recipe, fmt)
        old = self.origin
        if old.same_scales(origin):
            self.origin = origin
            return
        fmt_max = ELEMENT_MAX[fmt]
        fallback: torch.Tensor | float = 1.0
        if old.fmt is not None and old.margin is not None and old.custom_scale is False:
            # fmt_max / amax / 2**margin with the amax the old scale stands for: the old
            # scale times the ratio of the targets, in float64, rounded once to FP32
            # (and kept finite, as scale_from_amax keeps its scales).
            ratio = (fmt_max / 2.0**recipe.margin) / (ELEMENT_MAX[old.fmt] / 2.0**old.margin)
            converted = (self.scale.double() * ratio).clamp_max(FP32_MAX).float()
            fallback = torch.where(self.scale == 1.0, 1.0, converted)
        amax = self.history.amax(dim=0)
        self.scale.copy_(scale_from_amax(amax, fmt_max, margin=recipe.margin, fallback=fallback))
        self.origin = origin


def check_scaling_tensors(history: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError unless ``history`` ``[L>=1, n]`` and ``scale`` ``[n]`` are floating-point,
    finite, with amaxes >= 0 and scales > 0: anything else would quantize with NaN or
    infinite scales, or zero every output, from the first step on."""
    if not (isinstance(history, torch.Tensor) and isinstance(scale, torch.Tensor)):
        raise ValueError("delayed-scaling state must hold tensors")
    if not (history.is_floating_point() and scale.is_floating_point()):
        raise ValueError(
            f"delayed-scaling state must be floating point, got amax_history "
            f"{history.dtype} and scale {scale.dtype}"
        )
    if (
        history.dim() != 2
        or scale.dim() != 1
        or history.shape[1] != scale.shape[0]
        or history.shape[0] < 1
    ):
        raise ValueError(
            f"delayed-scaling state has inconsistent shapes: amax_history "
            f"{tuple(history.shape)} (expected [L >= 1, n]), scale {tuple(scale.shape)} "
            f"(expected [n])"
        )
    # Smallest and largest of each in one read (NaN propagates, failing every test below).
    h_min, h_max = torch.aminmax(history.detach())
    s_min, s_max = torch.aminmax(scale.detach())
    h_min, h_max, s_min, s_max = torch.stack([h_min, h_max, s_min, s_max]).tolist()
    if not (s_min > 0 and s_max < math.inf):
        raise ValueError(
            f"delayed-scaling scales must be finite and positive, got {scale.tolist()}"
        )
    if not (h_min >= 0 and h_max < math.inf):
        bad = history[~(torch.isfinite(history) & (history >= 0))]
        raise ValueError(
            f"delayed-scaling amax history must be finite and >= 0, found {bad[:4].tolist()}"
        )


class Slab:
    """The contiguous amax history and scales of every module of one key and direction.

    Members are held weakly: a module that is garbage collected leaves dead columns,
    which the next update compacts away — except in slabs reduced over a process group,
    whose column layout must stay identical on every rank whatever each rank's garbage
    collector did (there, a dead module's columns stay, holding amax 0).
    """

    __slots__ = (
        "recipe",
        "group",
        "fmt",
        "history",
        "scale",
        "members",
        "lost_members",
        "owner",
        "formula",
    )

    @_normal_tensors
    def __init__(self, recipe: DelayedScaling, group: Any, fmt: str, device: torch.device):
        self.recipe = recipe
        self.group = group
        self.fmt = fmt
        self.members: list[weakref.ref[ScalingMeta]] = []
        self.lost_members = False
        self.owner: Any = None  # the owner state that made it (owners.py: DelayedState)
        self.history = torch.zeros(recipe.amax_history_len, 0, device=device)
        self.scale = torch.ones(0, device=device)
        # The fused update's constants (target, floor, least scale, most_recent) under
        # fastcast's own formula, fixed with the (frozen) recipe; None under a custom one.
        self.formula: tuple[float, float, float, bool] | None = None
        algo = recipe.amax_compute_algo
        if recipe.scaling_factor_compute_algo is None and isinstance(algo, str):
            fmt_max = ELEMENT_MAX[fmt]
            target = fmt_max / 2.0**recipe.margin
            least = min_scale(fmt_max, False) if recipe.margin else 0.0
            self.formula = (target, target / FP32_MAX, least, algo == "most_recent")

    def live_members(self) -> list[ScalingMeta]:
        return [m for m in (ref() for ref in self.members) if m is not None]

    def add(self, meta: ScalingMeta) -> None:
        """Take ``meta`` in: its values, fitted to this slab's recipe (format and margin,
        see ``ScalingMeta.adopt``, then history length), become new columns of the slab."""
        meta.detach()
        # Refitted before the resize, so that a shorter window still recomputes the
        # scales from every amax the saved history holds.
        meta.adopt(self.recipe, self.fmt)
        meta.resize_history(self.recipe.amax_history_len)
        self._rebuild([*self.live_members(), meta])

    def remove(self, meta: ScalingMeta) -> None:
        meta.slab = None
        self._rebuild([m for m in self.live_members() if m is not meta])

    def _member_lost(self, ref: weakref.ref) -> None:
        self.lost_members = True

    @_normal_tensors
    def _rebuild(self, members: list[ScalingMeta]) -> None:
        histories = [m.history for m in members]
        scales = [m.scale for m in members]
        device = self.history.device
        self.history = (
            torch.cat(histories, dim=1)
            if histories
            else torch.zeros(self.recipe.amax_history_len, 0, device=device)
        )
        self.scale = torch.cat(scales) if scales else torch.ones(0, device=device)
        offset = 0
        for m in members:
            m._own(self.history[:, offset : offset + m.n], self.scale[offset : offset + m.n])
            m.slab = self
            offset += m.n
        self.members = [weakref.ref(m, self._member_lost) for m in members]
        self.lost_members = False

    def update(self) -> None:
        """Reduce this step's amaxes, compute new scales from the window, roll history.

        Only columns that recorded an amax this step (row 0 > 0, after the reduction)
        move: the others, a module that did not run (another model under an equal recipe,
        an expert that got no tokens) or saw only zeros, keep their history and scale, so
        one model's steps never age another's window.
        """
        if self.lost_members and self.group is None:
            self._rebuild(self.live_members())
        if not self.members:
            return
        recipe = self.recipe
        history = self.history
        if self.group is not None and recipe.reduce_amax:
            all_reduce_max(history[0], self.group)
        if self.formula is not None:
            # fastcast's formula: one fused operator where there is one (CPU), else the
            # same in a dozen tensor operations. (A slab's tensors are contiguous: made by
            # torch.zeros/ones or torch.cat, never replaced by views.)
            op = fused_op("delayed_update", history)
            if op is not None:
                op(history, self.scale, *self.formula)
            else:
                delayed_update_reference(
                    history, self.scale, ELEMENT_MAX[self.fmt], recipe.margin, self.formula[3]
                )
            return
        algo = recipe.amax_compute_algo
        fmt_max = ELEMENT_MAX[self.fmt]
        if algo == "max":
            amax = history.amax(dim=0)
        elif algo == "most_recent":
            amax = history[0].clone()
        else:
            amax = algo(history)
        if recipe.scaling_factor_compute_algo is not None:
            scale = recipe.scaling_factor_compute_algo(amax, self.scale, fmt_max, recipe)
        else:
            scale = scale_from_amax(amax, fmt_max, margin=recipe.margin, fallback=self.scale)
        ran = history[0] > 0
        self.scale.copy_(torch.where(ran, scale, self.scale))
        if history.shape[0] > 1:
            history.copy_(torch.where(ran, torch.roll(history, -1, dims=0), history))
        history[0].zero_()
