"""How delayed scaling's per-module state is saved and loaded: extra-state kind 1.

The codec (``fastcast.serialization.extra_state``) writes slots 0..3 of the header
(magic, version, kind, header length); this format fills the rest (integers stored
exactly as float32; -1 marks a field that is unknown)::

    [4]  amax history rows L             [9]  margin
    [5]  forward columns (2 or 0)        [10] amax_compute_algo (0 max, 1 most_recent,
    [6]  backward columns (1 or 0)            2 a callable)
    [7]  forward element format          [11] scaling_factor_compute_algo set (0/1)
         (0 e4m3, 1 e5m2)                [12] reduce_amax (0/1)
    [8]  backward element format         [13..15] reserved, 0

then the scales, forward columns (input, weight) first, then backward (grad_output);
then the amax history [L, columns] row by row: row 0 is the step being recorded, rows
1..L-1 the previous steps, oldest first.

Version 1 saved a dict ``{"forward": {"amax_history", "scale"}, "backward": ...}`` without
the recipe fields (origin unknown); TransformerEngine's state converts through
``te_state.py``. Whatever the source, every value is validated (finite, positive
scales; finite, non-negative amaxes; consistent shapes; known fields) before the metas are
made, holding copies on the CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...formats import FP8_FORMATS
from ...recipe import MAX_MARGIN
from ...serialization.state_format import (
    HEADER,
    UNKNOWN,
    StateFormat,
    check_holds,
    check_readable,
    register_state_format,
)
from .state import (
    BACKWARD,
    FORWARD,
    UNKNOWN_ORIGIN,
    ScalingMeta,
    ScalingOrigin,
    check_scaling_tensors,
)
from .te_state import from_transformer_engine, is_transformer_engine_state

# Header slots.
_ROWS, _FWD_COLS, _BWD_COLS, _FWD_FMT, _BWD_FMT = 4, 5, 6, 7, 8
_MARGIN, _ALGO, _CUSTOM, _REDUCE = 9, 10, 11, 12
_RESERVED = range(13, HEADER)
_COLUMNS = {FORWARD: 2, BACKWARD: 1}  # what an fc.Linear keeps per direction
_NAMES = {FORWARD: "forward", BACKWARD: "backward"}
_FORMATS = FP8_FORMATS  # codes 0, 1 (the order is part of the file format)
_ALGOS = ("max", "most_recent", "callable")


@register_state_format
class DelayedStateFormat(StateFormat):
    """``ScalingMeta`` per direction (forward, backward) in the extra-state tensor."""

    kind = 1
    name = "delayed_scaling"
    state_type = ScalingMeta
    version_1_names = _NAMES

    def encode(
        self, module_state: dict[Any, ScalingMeta]
    ) -> tuple[dict[int, float], list[torch.Tensor]]:
        if not module_state.keys() <= {FORWARD, BACKWARD}:
            raise ValueError(
                "fc.Linear holds delayed-scaling state under keys fastcast's checkpoint "
                f"format does not know ({sorted(map(repr, module_state))})"
            )
        metas = module_state
        parts = [metas[d] for d in (FORWARD, BACKWARD) if d in metas]
        rows = parts[0].history.shape[0]
        if any(m.history.shape[0] != rows for m in parts):
            raise ValueError("delayed-scaling metas of one module must have one history length")
        origin = parts[0].origin
        fields = {
            _ROWS: rows,
            _FWD_COLS: metas[FORWARD].n if FORWARD in metas else 0,
            _BWD_COLS: metas[BACKWARD].n if BACKWARD in metas else 0,
            _FWD_FMT: _code(metas[FORWARD].origin.fmt, _FORMATS) if FORWARD in metas else UNKNOWN,
            _BWD_FMT: _code(metas[BACKWARD].origin.fmt, _FORMATS) if BACKWARD in metas else UNKNOWN,
            _MARGIN: UNKNOWN if origin.margin is None else origin.margin,
            _ALGO: _code(origin.amax_compute_algo, _ALGOS),
            _CUSTOM: UNKNOWN if origin.custom_scale is None else int(origin.custom_scale),
            _REDUCE: UNKNOWN if origin.reduce_amax is None else int(origin.reduce_amax),
        }
        scales = [m.scale.detach().float().cpu() for m in parts]
        history = torch.cat([m.history.detach().float().cpu() for m in parts], dim=1)
        return {k: float(v) for k, v in fields.items()}, [*scales, history.reshape(-1)]

    def decode(self, head: list[int], values: torch.Tensor, owner: str) -> dict[int, ScalingMeta]:
        def refuse(problem: str) -> ValueError:
            return ValueError(f"{owner}: {problem}")

        rows, fwd_cols, bwd_cols = head[_ROWS], head[_FWD_COLS], head[_BWD_COLS]
        if (
            rows < 1
            or fwd_cols not in (0, _COLUMNS[FORWARD])
            or bwd_cols not in (0, _COLUMNS[BACKWARD])
            or fwd_cols + bwd_cols == 0
        ):
            raise refuse(
                f"delayed-scaling state with {rows} history rows, {fwd_cols} forward and "
                f"{bwd_cols} backward columns; an fc.Linear keeps >= 1 rows and 2 forward, "
                "1 backward columns"
            )
        columns = fwd_cols + bwd_cols
        if values.numel() != columns + rows * columns:
            raise refuse(
                f"delayed-scaling state of {rows} rows x {columns} columns must hold "
                f"{HEADER + columns + rows * columns} values, got {HEADER + values.numel()}"
            )
        fields = {
            "forward format": (head[_FWD_FMT], len(_FORMATS)),
            "backward format": (head[_BWD_FMT], len(_FORMATS)),
            "amax_compute_algo": (head[_ALGO], len(_ALGOS)),
            "scaling_factor_compute_algo": (head[_CUSTOM], 2),
            "reduce_amax": (head[_REDUCE], 2),
        }
        for name, (value, count) in fields.items():
            if not UNKNOWN <= value < count:
                raise refuse(f"delayed-scaling state has an invalid {name} code {value}")
        # The margin as a recipe may have it (a larger one would fail the first step
        # after the load, 2.0**margin overflowing), or unknown.
        if not UNKNOWN <= head[_MARGIN] <= MAX_MARGIN:
            raise refuse(
                f"delayed-scaling state has an invalid margin {head[_MARGIN]} (header slot "
                f"{_MARGIN}; a DelayedScaling margin is 0..{MAX_MARGIN}, or -1 if unknown)"
            )
        reserved = [(slot, head[slot]) for slot in _RESERVED if head[slot] != 0]
        if reserved:
            slot, value = reserved[0]
            raise refuse(
                f"delayed-scaling state has {value} in reserved header slot {slot} (a newer "
                "fastcast's field?); this fastcast reads only zeros there"
            )
        scales = values[:columns]
        history = values[columns:].reshape(rows, columns)
        # All values in one read: finite and >= 0, scales > 0 (NaN fails every comparison).
        low, high = torch.aminmax(values)
        low, high, scale_low = torch.stack([low, high, scales.min()]).tolist()
        checked = low >= 0 and high < math.inf and scale_low > 0

        def known(code: int, names: tuple[str, ...]) -> str | None:
            return None if code == UNKNOWN else names[code]

        def flag(code: int) -> bool | None:
            return None if code == UNKNOWN else bool(code)

        def origin(fmt_code: int) -> ScalingOrigin:
            return ScalingOrigin(
                known(fmt_code, _FORMATS),
                None if head[_MARGIN] == UNKNOWN else head[_MARGIN],
                known(head[_ALGO], _ALGOS),
                flag(head[_CUSTOM]),
                flag(head[_REDUCE]),
            )

        parts = {}
        offset = 0
        for direction, cols, fmt in (
            (FORWARD, fwd_cols, head[_FWD_FMT]),
            (BACKWARD, bwd_cols, head[_BWD_FMT]),
        ):
            if cols:
                parts[direction] = (
                    history[:, offset : offset + cols],
                    scales[offset : offset + cols],
                    origin(fmt),
                )
                offset += cols
        return _metas(parts, owner, checked)

    def load(self, parts: dict[Any, Any], owner: str) -> dict[int, ScalingMeta]:
        """Version 1: per direction ``{"amax_history", "scale"}``; no recipe fields."""
        tensors = {}
        for direction, part in parts.items():
            if not isinstance(part, dict) or set(part) != {"amax_history", "scale"}:
                raise ValueError(
                    f"{owner}: extra state '{_NAMES[direction]}' must hold exactly the "
                    "tensors 'amax_history' and 'scale'"
                )
            tensors[direction] = (part["amax_history"], part["scale"], UNKNOWN_ORIGIN)
        return _metas(tensors, owner)

    def from_foreign(self, state: Any, owner: str) -> dict[int, ScalingMeta] | None:
        if not is_transformer_engine_state(state):
            return None
        return from_transformer_engine(state, owner)

    def view(self, module_state: dict[Any, ScalingMeta]) -> dict[str, Any]:
        return {
            _NAMES[direction]: {
                "amax_history": meta.history,
                "scale": meta.scale,
                "origin": meta.origin._asdict(),
            }
            for direction, meta in sorted(module_state.items())
        }


def _code(value: str | None, names: tuple[str, ...]) -> int:
    return UNKNOWN if value is None else names.index(value)


def _metas(
    parts: dict[int, tuple[torch.Tensor, torch.Tensor, ScalingOrigin]],
    owner: str,
    checked: bool = False,
) -> dict[int, ScalingMeta]:
    """Validated metas (on the CPU, holding copies) from per-direction ``(history, scale,
    origin)``; ``checked``: the values are known to be finite, amaxes >= 0, scales > 0."""
    metas = {}
    for direction, (history, scale, origin) in parts.items():
        name = _NAMES[direction]
        check_holds(history, owner, f"{name} amax history")
        check_holds(scale, owner, f"{name} scale")
        if not checked:
            for t, what in ((history, "amax_history"), (scale, "scale")):
                if isinstance(t, torch.Tensor):
                    check_readable(t, owner, f"{name} {what}")
            # The column count first: a state of zero columns has nothing for the value
            # checks to read (torch's min of an empty tensor is an error of its own).
            if isinstance(scale, torch.Tensor) and scale.dim() == 1:
                _check_columns(scale.shape[0], direction, owner)
            try:
                check_scaling_tensors(history, scale)
            except ValueError as exc:
                raise ValueError(f"{owner}: {name} {exc}") from None
        _check_columns(scale.shape[0], direction, owner)
        history = history.detach().to("cpu", torch.float32, copy=True)
        metas[direction] = ScalingMeta.holding(
            history, scale.detach().to("cpu", torch.float32, copy=True), origin
        )
    rows = {meta.history.shape[0] for meta in metas.values()}
    if len(rows) > 1:
        raise ValueError(f"{owner}: the directions' amax histories differ in length {sorted(rows)}")
    return metas


def _check_columns(columns: int, direction: int, owner: str) -> None:
    if columns != _COLUMNS[direction]:
        raise ValueError(
            f"{owner}: {_NAMES[direction]} delayed-scaling state has {columns} columns; an "
            f"fc.Linear keeps {_COLUMNS[direction]}"
        )
