"""What an inspection recorded, as rows, tables and the layers to act on.

``Report`` sorts the rows worst first by ``rank_db`` (the lower of the whole tensor's
SQNR and its bulk's, so an outlier that flushes everything else is seen), flags the
layers whose ``rank_db`` falls below a threshold per element format
(``DEFAULT_THRESHOLD_DB``), suggests what to change, and writes JSON lines, a heatmap
(matplotlib) or TensorBoard scalars.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..recipe import Format
from .stats import OPERANDS, OUTLIER_RATIO

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRICS = ("rank_db", "sqnr_db", "bulk_sqnr_db", "underflow", "outliers", "saturated")

# Default SQNR thresholds (dB) per element format, below which a layer is flagged. The
# training-step benchmark's operands quantize at about 31 dB in E4M3, 25.5 dB in E5M2 and
# 17 dB in NVFP4's E2M1 blocks (docs/numerics.md); the thresholds sit 6 dB (4x the noise
# power) below those.
DEFAULT_THRESHOLD_DB: dict[str, float] = {"e4m3": 25.0, "e5m2": 19.0, "e2m1": 11.0}


def _level(value: Any, what: str) -> float:
    """``value`` as a finite number of dB, or a clear error naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"fc.inspect: {what} must be a number of dB, got {value!r}")
    level = float(value)
    if not math.isfinite(level):
        raise ValueError(f"fc.inspect: {what} must be a finite number of dB, got {value!r}")
    return level


def check_threshold(threshold_db: Any) -> float | dict[str, float] | None:
    """``threshold_db`` checked: None (the defaults), a finite number of dB, or a dict from
    element formats (``DEFAULT_THRESHOLD_DB``'s keys) to finite numbers of dB."""
    if threshold_db is None:
        return None
    if isinstance(threshold_db, Mapping):
        levels = {}
        for fmt, value in threshold_db.items():
            if fmt not in DEFAULT_THRESHOLD_DB:
                raise ValueError(
                    f"fc.inspect: threshold_db has an unknown element format {fmt!r}; the "
                    f"formats are {', '.join(map(repr, DEFAULT_THRESHOLD_DB))}"
                )
            levels[fmt] = _level(value, f"threshold_db[{fmt!r}]")
        return levels
    if isinstance(threshold_db, bool) or not isinstance(threshold_db, numbers.Real):
        raise TypeError(
            "fc.inspect: threshold_db must be None, a number of dB or a dict from element "
            f"formats to numbers of dB (e.g. {{'e4m3': 25.0}}), got {threshold_db!r}"
        )
    return _level(threshold_db, "threshold_db")


def _worst_first(row: dict[str, Any]) -> tuple:
    level = row["rank_db"]
    return (-math.inf if math.isnan(level) else level, -row["underflow"], -row["saturated"])


class Report:
    """What an inspection recorded: rows, a per-layer table, the layers to act on."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        threshold_db: float | dict[str, float] | None = None,
        recipes: dict[str, Any] | None = None,
    ) -> None:
        self._rows = sorted(rows, key=_worst_first)
        threshold_db = check_threshold(threshold_db)
        self.threshold_db = DEFAULT_THRESHOLD_DB if threshold_db is None else threshold_db
        self._recipes = dict(recipes or {})

    def threshold(self, fmt: str) -> float:
        """The level (dB) of ``rank_db`` below which an operand in ``fmt`` is flagged."""
        if isinstance(self.threshold_db, dict):
            return self.threshold_db.get(fmt, DEFAULT_THRESHOLD_DB.get(fmt, 0.0))
        return self.threshold_db

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (step, layer, operand, layout), worst ``rank_db`` first: ``layer``,
        ``operand``, ``layout``, ``step``, ``fmt``, ``amax``, ``scale`` (geomean over
        blocks), ``scale_min``, ``scale_max``, ``underflow``, ``saturated``, ``rank_db``
        (the lower of the next two), ``sqnr_db`` (whole tensor), ``bulk_sqnr_db`` (the
        elements within ``OUTLIER_RATIO`` times the median magnitude), ``outliers`` (the
        fraction of elements beyond), ``stale`` (delayed scaling; else None),
        ``elements``, ``calls``."""
        return [dict(r) for r in self._rows]

    def steps(self) -> list[int]:
        return sorted({r["step"] for r in self._rows})

    def summary(self) -> list[dict[str, Any]]:
        """Per (layer, operand, layout) over the recorded steps, worst first: the worst
        ``rank_db``, SQNR and bulk SQNR, the mean SQNR, the largest underflow, outlier
        share, saturation, amax and staleness, the scale spread (smallest and largest
        block scale seen)."""
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for row in self._rows:
            groups.setdefault((row["layer"], row["operand"], row["layout"]), []).append(row)
        out = []
        for (layer, operand, layout), rows in groups.items():
            finite = [r["sqnr_db"] for r in rows if math.isfinite(r["sqnr_db"])]
            stales = [r["stale"] for r in rows if r["stale"] is not None]
            out.append(
                {
                    "layer": layer,
                    "operand": operand,
                    "layout": layout,
                    "fmt": rows[0]["fmt"],
                    "steps": len(rows),
                    "rank_db": min(r["rank_db"] for r in rows),
                    "sqnr_db": min(r["sqnr_db"] for r in rows),
                    "bulk_sqnr_db": min(r["bulk_sqnr_db"] for r in rows),
                    "sqnr_db_mean": sum(finite) / len(finite) if finite else math.inf,
                    "underflow": max(r["underflow"] for r in rows),
                    "outliers": max(r["outliers"] for r in rows),
                    "saturated": max(r["saturated"] for r in rows),
                    "amax": max(r["amax"] for r in rows),
                    "scale_min": min(r["scale_min"] for r in rows),
                    "scale_max": max(r["scale_max"] for r in rows),
                    "stale": max(stales) if stales else None,
                }
            )
        return sorted(out, key=_worst_first)

    def flagged(self) -> list[str]:
        """Layers with an operand whose ``rank_db`` fell below its format's threshold,
        worst first."""
        names: list[str] = []
        for row in self.summary():
            if row["rank_db"] < self.threshold(row["fmt"]) and row["layer"] not in names:
                names.append(row["layer"])
        return names

    def _cold_start(self) -> list[str]:
        """Flagged delayed-scaling layers whose low SQNR comes from the first recorded step
        alone (step 0 quantizes with the initial scales, 1: no amax recorded yet)."""
        first = min(self.steps(), default=0)
        cold = []
        for layer in self.flagged():
            below = [
                r
                for r in self._rows
                if r["layer"] == layer and r["rank_db"] < self.threshold(r["fmt"])
            ]
            if first == 0 and all(r["step"] == first and r["stale"] is not None for r in below):
                cold.append(layer)
        return cold

    def actions(self) -> list[str]:
        """One-line changes that would act on what the report shows."""
        out: list[str] = []
        cold = self._cold_start()
        flagged = [n for n in self.flagged() if n not in cold]
        if cold:
            out.append(
                f"{len(cold)} delayed-scaling layer(s) fall below the threshold at step 0 only "
                "(initial scales, no amax history yet): calibrate before training, "
                "with fc.autocast(enabled=False, calibrating=True): model(batch)"
            )
        if flagged:
            names = ", ".join(repr(n) for n in flagged)
            comma = "," if len(flagged) == 1 else ""
            out.append(
                f"keep {len(flagged)} layer(s) in high precision (SQNR of the tensor or of "
                "its bulk below threshold): "
                f"fc.convert(model, fc.keep_high_precision(model, names=({names}{comma})), "
                "recipe=recipe)"
            )
        # Outliers that cost the rest of the tensor its precision: the bulk flagged, 6 dB
        # or more below the whole tensor (whose SQNR is then the outliers').
        hurt = [
            r
            for r in self._rows
            if r["bulk_sqnr_db"] < self.threshold(r["fmt"])
            and r["bulk_sqnr_db"] <= r["sqnr_db"] - 6.0
        ]
        if hurt:
            worst = min(hurt, key=lambda r: r["bulk_sqnr_db"])
            out.append(
                f"outliers flush the bulk of {len({(r['layer'], r['operand']) for r in hurt})} "
                f"operand(s) (worst: {worst['layer']!r} {worst['operand']} at step "
                f"{worst['step']}: {worst['outliers']:.2%} of its elements beyond "
                f"{OUTLIER_RATIO:g}x the median leave the rest at {worst['bulk_sqnr_db']:.1f} dB "
                f"against {worst['sqnr_db']:.1f} dB for the whole tensor, "
                f"{worst['underflow']:.1%} of its non-zero elements flushed to zero): keep the "
                "layer in high precision, or "
                "use a recipe with smaller scaling blocks, which confine an outlier to its block"
            )
        # HYBRID's E5M2 gradients: suggested when they are the weak operand (3 dB or more
        # below the E4M3 operands, or below their threshold), leaving out a delayed-scaling
        # cold start (step 0), which E4M3 would not cure.
        skip_first = bool(cold)
        by_recipe: dict[Any, tuple[list[float], list[float], list[dict[str, Any]]]] = {}
        for row in self._rows:
            recipe = self._recipes.get(row["layer"])
            if getattr(recipe, "fp8_format", None) is not Format.HYBRID:
                continue
            if (skip_first and row["step"] == 0) or not math.isfinite(row["sqnr_db"]):
                continue
            e4, e5, rows = by_recipe.setdefault(recipe, ([], [], []))
            if row["fmt"] == "e5m2":
                e5.append(row["sqnr_db"])
                rows.append(row)
            else:
                e4.append(row["sqnr_db"])
        for recipe, (e4, e5, rows) in by_recipe.items():
            if not e5 or not e4:
                continue
            m4, m5 = sum(e4) / len(e4), sum(e5) / len(e5)
            if m4 - m5 >= 3.0 or min(e5) < self.threshold("e5m2"):
                underflow = max(r["underflow"] for r in rows)
                out.append(
                    f"E5M2 gradients are the weak operand ({m5:.1f} dB mean against "
                    f"{m4:.1f} dB for the E4M3 operands, underflow up to {underflow:.2%}): "
                    f"recipe = fc.{type(recipe).__name__}(fp8_format=fc.Format.E4M3)"
                )
        # Scales too small for the tensor, and values clipped for it (0.1% or more).
        stale = [
            r
            for r in self._rows
            if r["stale"] is not None and r["stale"] > 1.0 and r["saturated"] >= 1e-3
        ]
        if stale:
            worst = max(stale, key=lambda r: r["stale"])
            out.append(
                f"delayed scales too old ({worst['layer']} {worst['operand']} at step "
                f"{worst['step']}: amax "
                f"{worst['stale']:.2f}x the amax behind its scale, saturated "
                f"{worst['saturated']:.2%}): recipe = fc.DelayedScaling(margin=1) (or "
                "amax_history_len=16, or fc.Float8CurrentScaling())"
            )
        return out

    def table(self, limit: int | None = None) -> str:
        """The per-layer table (markdown), worst first; ``limit`` rows at most. The dB
        columns are each the worst over the steps, but for the mean SQNR."""
        header = (
            "| layer | operand | layout | fmt | steps | rank dB | SQNR dB | bulk SQNR dB | "
            "mean SQNR dB | underflow | outliers | saturated | amax | scale min..max | stale |"
        )
        lines = [header, "|" + "---|" * 15]
        rows = self.summary()
        for row in rows[:limit] if limit else rows:
            mark = " **!**" if row["rank_db"] < self.threshold(row["fmt"]) else ""
            stale = "" if row["stale"] is None else f"{row['stale']:.2f}"
            lines.append(
                f"| {row['layer']}{mark} | {row['operand']} | {row['layout']} | {row['fmt']} | "
                f"{row['steps']} | {row['rank_db']:.1f} | {row['sqnr_db']:.1f} | "
                f"{row['bulk_sqnr_db']:.1f} | {row['sqnr_db_mean']:.1f} | "
                f"{row['underflow']:.2%} | {row['outliers']:.2%} | {row['saturated']:.3%} | "
                f"{row['amax']:.3g} | {row['scale_min']:.3g}..{row['scale_max']:.3g} | {stale} |"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        if not self._rows:
            return (
                "fc.inspect: nothing recorded (no sampled step ran an fc.Linear eagerly "
                "under fc.autocast)"
            )
        parts = [self.table()]
        actions = self.actions()
        if actions:
            parts.append("\n".join(f"- {a}" for a in actions))
        return "\n\n".join(parts)

    def to_jsonl(self, path: str | os.PathLike[str]) -> None:
        """``rows()`` as JSON lines (standard JSON: an exact, infinite SQNR is null)."""
        with open(path, "w") as f:
            for row in self._rows:
                clean = {
                    k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in row.items()
                }
                f.write(json.dumps(clean) + "\n")

    def heatmap(
        self,
        path: str | os.PathLike[str],
        metric: str = "rank_db",
        *,
        operands: Iterable[str] = OPERANDS,
        title: str | None = None,
    ) -> Figure:
        """A PNG at ``path``: one row per (layer, operand) (its worst layout), one column
        per step, coloured by ``metric`` (one of ``METRICS``: ``rank_db``, the one rows
        are ranked by, by default). Returns the matplotlib ``Figure`` (made without
        pyplot, so the process's backend is left as it is; it can be changed and saved
        again). Needs matplotlib."""
        if metric not in METRICS:
            raise ValueError(f"fc.inspect heatmap: metric must be one of {METRICS}, got {metric!r}")
        try:
            # The Figure class itself, not pyplot: no backend is chosen or changed for the
            # user's process, and no figure is left registered anywhere.
            from matplotlib.figure import Figure  # noqa: PLC0415 - optional: [dev], [bench]
        except ImportError:
            raise ImportError(
                "fastcast.numerics: the heatmap needs matplotlib (pip install matplotlib); "
                "rows(), table() and to_jsonl() do not"
            ) from None
        if not self._rows:
            raise ValueError("fc.inspect heatmap: nothing recorded")
        operands = tuple(operands)
        steps = self.steps()
        labels: list[str] = []
        order = {}
        for row in sorted(self._rows, key=lambda r: (r["layer"], OPERANDS.index(r["operand"]))):
            label = f"{row['layer']} {row['operand']}"
            if row["operand"] in operands and label not in order:
                order[label] = len(labels)
                labels.append(label)
        in_db = metric.endswith("_db")
        worse = min if in_db else max
        grid = [[math.nan] * len(steps) for _ in labels]
        column = {s: i for i, s in enumerate(steps)}
        for row in self._rows:
            label = f"{row['layer']} {row['operand']}"
            if label not in order:
                continue
            value = row[metric]
            if in_db and not math.isfinite(value):
                value = 99.0 if value > 0 else math.nan
            cell = grid[order[label]][column[row["step"]]]
            grid[order[label]][column[row["step"]]] = (
                value if math.isnan(cell) else worse(cell, value)
            )
        fig = Figure(figsize=(max(4.0, 0.3 * len(steps) + 3), 0.28 * len(labels) + 1.5))
        ax = fig.subplots()
        cmap = "viridis" if in_db else "magma_r"
        image = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ticks = list(range(0, len(steps), max(1, len(steps) // 12)))
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
        ax.set_xlabel("step")
        names = {
            "rank_db": "SQNR, whole or bulk, the lower (dB)",
            "sqnr_db": "SQNR (dB)",
            "bulk_sqnr_db": "bulk SQNR (dB)",
            "underflow": "underflow fraction",
            "outliers": "outlier fraction",
            "saturated": "saturated",
        }
        fig.colorbar(image, ax=ax, label=names[metric])
        ax.set_title(title or f"fc.inspect: {names[metric]} per layer and step", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        return fig

    def to_tensorboard(self, writer_or_dir: Any) -> None:
        """Write the rows as TensorBoard scalars (``numerics/<layer>/<operand>/<layout>/
        <metric>`` at each step): a ``SummaryWriter`` or a log directory. Needs
        ``torch.utils.tensorboard`` (the ``tensorboard`` package)."""
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
        except ImportError:
            raise ImportError(
                "fastcast.numerics: TensorBoard output needs the tensorboard package "
                "(pip install tensorboard)"
            ) from None
        own = not hasattr(writer_or_dir, "add_scalar")
        writer = SummaryWriter(writer_or_dir) if own else writer_or_dir
        for row in sorted(self._rows, key=lambda r: r["step"]):
            tag = f"numerics/{row['layer']}/{row['operand']}/{row['layout']}"
            for metric in METRICS:
                value = row[metric]
                if math.isfinite(value):
                    writer.add_scalar(f"{tag}/{metric}", value, row["step"])
        if own:
            writer.close()
