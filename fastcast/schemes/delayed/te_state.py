"""TransformerEngine's delayed-scaling extra state, read into ``ScalingMeta``s.

Only ever given what the restricted unpickler built inside ``fc.allow_unsafe_extra_state()``
(``fastcast.serialization.transformer_engine`` says what it may build); the extra-state
codec hands it over through ``saved_state.DelayedStateFormat.from_foreign``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...serialization.transformer_engine import describe_items, hashable
from .state import BACKWARD, FORWARD, ScalingMeta

# Per direction: the scale key, the history key, the reciprocal-scale key, and how many
# columns one GEMM has in TransformerEngine (forward: input, weight, output; backward:
# grad_output, grad_input). fastcast keeps the leading ones: input and weight forward,
# grad_output backward.
_TE_LAYOUT = {
    FORWARD: ("scale_fwd", "amax_history_fwd", "scale_inv_fwd", 3),
    BACKWARD: ("scale_bwd", "amax_history_bwd", "scale_inv_bwd", 2),
}
_KEPT_COLUMNS = {FORWARD: 2, BACKWARD: 1}
# Keys that hold no state of their own, and so are checked but not carried over:
# - scale_inv_fwd/_bwd (older versions): the reciprocals of the scales, recomputed from them;
# - extra_fp8_variables: the module's Python bookkeeping (GEMM count, format maxima,
#   positions in TransformerEngine's global buffers, checkpoint flags), which has no
#   meaning outside TransformerEngine; the GEMM count is checked;
# - recipe (newer versions): TransformerEngine's recipe object, i.e. configuration;
#   in fastcast the recipe is whatever fc.autocast is given.
_TE_METADATA = frozenset({"scale_inv_fwd", "scale_inv_bwd", "extra_fp8_variables", "recipe"})
TE_KEYS = frozenset({k for layout in _TE_LAYOUT.values() for k in layout[:3]}) | _TE_METADATA


def from_transformer_engine(state: dict[Any, Any], owner: str) -> dict[int, ScalingMeta]:
    """fastcast metas from a TransformerEngine ``Linear``'s delayed-scaling extra state.

    TransformerEngine keeps, per GEMM, scales ``scale_fwd`` ``[3]`` and an amax history
    ``amax_history_fwd`` ``[L, 3]`` for (input, weight, output), and ``scale_bwd`` ``[2]``,
    ``amax_history_bwd`` ``[L, 2]`` for (grad_output, grad_input); row 0 of a history is
    the step being recorded, as in fastcast, and a scale multiplies before the cast, as in
    fastcast. The input, weight and grad_output columns become fastcast's metas.

    Not carried over: the output and grad_input columns, which scale a GEMM's *output* when
    TransformerEngine writes it in FP8 for the next FP8 consumer. fastcast's GEMMs always
    write high precision, so these scales have no tensor to apply to. The metadata keys
    listed in ``_TE_METADATA`` are checked and left behind (see there). Any other key, or a
    layout other than a single GEMM's, is an error rather than state quietly left behind.
    """
    state = dict(state)  # plain dict methods, whatever kind of mapping was unpickled
    found = describe_items(state)
    unknown = [k for k in state if not (hashable(k) and k in TE_KEYS)]
    if unknown:
        raise ValueError(
            f"{owner}: TransformerEngine extra state with keys fastcast does not know: "
            f"{', '.join(map(repr, unknown))}; refusing rather than dropping them "
            f"(found {found})"
        )
    extra = state.get("extra_fp8_variables", {})
    if not isinstance(extra, dict):
        raise ValueError(
            f"{owner}: TransformerEngine 'extra_fp8_variables' should be a dict (found {found})"
        )
    gemms = extra.get("num_gemms", 1)
    if gemms != 1:
        raise ValueError(
            f"{owner}: the TransformerEngine extra state holds the scales of {gemms!r} GEMMs "
            f"(LayerNormMLP or GroupedLinear?); an fc.Linear has one (found {found})"
        )
    metas = {}
    for direction, (scale_key, history_key, inv_key, columns) in _TE_LAYOUT.items():
        scale, history, inv = state.get(scale_key), state.get(history_key), state.get(inv_key)
        if scale is None and history is None and inv is None:
            continue
        if not (
            _float_tensor(scale, 1)
            and _float_tensor(history, 2)
            and scale.shape[0] == columns
            and history.shape[1] == columns
            and history.shape[0] >= 1
            and (inv is None or (_float_tensor(inv, 1) and inv.shape == scale.shape))
        ):
            raise ValueError(
                f"{owner}: TransformerEngine extra state is not a single-GEMM Linear's: "
                f"expected floating-point tensors {scale_key} [{columns}] and {history_key} "
                f"[L, {columns}] (and {inv_key} [{columns}] if present); found {found}"
            )
        keep = _KEPT_COLUMNS[direction]
        try:  # detached: loaded scales are plain data, never part of an autograd graph
            metas[direction] = ScalingMeta.from_tensors(
                history[:, :keep].detach(), scale[:keep].detach()
            )
        except ValueError as exc:
            raise ValueError(f"{owner}: TransformerEngine {exc}") from None
    return metas


def _float_tensor(value: Any, dim: int) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == dim


def is_transformer_engine_state(state: Any) -> bool:
    """Whether an unpickled ``state`` is TransformerEngine's (a dict with one of its keys)."""
    return isinstance(state, dict) and any(hashable(k) and k in TE_KEYS for k in state)
