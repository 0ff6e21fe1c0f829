"""Render the benchmark tables of README and docs from the committed sample: ``make readme``.

README.md, docs/benchmarks.md and docs/profiling.md hold generated blocks between
``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` markers; ``python -m bench.readme``
rewrites each from ``bench/results/sample.json`` (per-call medians, inner loops divided
out) and leaves every other line alone, so rendering twice changes nothing. ``--check``
exits 1 when a page is not what the sample renders (a hand edit, or a sample updated without
``make readme``). Blocks:

- ``headline`` (README): a few rows of ``micro`` and the training step's ratios;
- ``micro``: autocast, Linear and quantize medians, ratios and targets;
- ``checkpoint``: checkpoint save/load times and ratios to ``nn.Linear``;
- ``overhead``: the overhead report stored in the sample (``fastcast.overhead``, put
  there by ``make bench-sample``), when it has one;
- ``train_step`` and ``train_compile``: the training-step benchmark, eager and compiled
  (``fastcast.train_step``, ``fastcast.train_step_compile``: ``bench.train_step --json``
  of the same ``make bench-sample`` run), when the sample has them.

The text around the blocks is prose and stays hand-written: check it when the numbers
move.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.report import ROOT, SAMPLE, Entry, format_ratio, format_time

README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "profiling.md")
Lookup = Callable[[str], Entry]


# --------------------------------------------------------------------------- cells


def join_times(seconds: Sequence[float]) -> str:
    """``1.33 / 1.35 µs``: times sharing a unit are written with it once."""
    parts = [format_time(s).split(" ") for s in seconds]
    units = {unit for _, unit in parts}
    if len(units) == 1:
        return " / ".join(number for number, _ in parts) + " " + parts[0][1]
    return " / ".join(" ".join(p) for p in parts)


def verdict(values: Sequence[float], limits: Sequence[float]) -> str:
    """``pass`` when every value is within its limit (one limit may serve them all)."""
    if len(limits) == 1:
        limits = list(limits) * len(values)
    ok = all(v <= limit for v, limit in zip(values, limits))
    return "pass" if ok else "**miss**"


class Row:
    """One table row: a label (``{test_name}`` fields become that test's median), the
    medians shown, the ratios ``(subject, reference)`` and an optional target."""

    def __init__(
        self,
        label: str,
        medians: Sequence[str] = (),
        ratios: Sequence[tuple[str, str]] = (),
        target: tuple[str, Sequence[float]] | None = None,
        note: str = "",
        ops: bool = False,
    ) -> None:
        self.label, self.medians, self.ratios = label, medians, ratios
        self.target, self.note, self.ops = target, note, ops

    def cells(self, get: Lookup) -> list[str]:
        label = re.sub(r"\{(test_\w+)\}", lambda m: format_time(get(m[1]).median), self.label)
        ratios = [get(s).median / get(r).median for s, r in self.ratios]
        target = ""
        if self.target is not None:
            text, limits = self.target
            target = f"{text}{self.note}: {verdict(ratios, limits)}"
        medians = join_times([get(n).median for n in self.medians]) if self.medians else ""
        if self.ops:  # the ATen operations one iteration dispatches, after the time
            medians += f" ({get(self.medians[0]).extra['aten_ops']:g} ops)"
        return [
            label,
            medians,
            " / ".join(format_ratio(r) for r in ratios),
            target,
        ]


class OpsRow(Row):
    """The ATen operations one fwd+bwd dispatches (``aten_ops``), against a limit."""

    def __init__(self, label: str, subject: str, limit: float) -> None:
        super().__init__(label)
        self.subject, self.limit = subject, limit

    def cells(self, get: Lookup) -> list[str]:
        label = re.sub(
            r"\{ops:(test_\w+)\}", lambda m: f"{get(m[1]).extra['aten_ops']:g}", self.label
        )
        value = get(self.subject).extra["aten_ops"]
        ok = "pass" if value <= self.limit else "**miss**"
        return [label, f"{value:g}", "", f"<= {self.limit:g}: {ok}"]


QUANTIZE_BOTH = ("test_current_scaling_both", "test_block_1x128_both", "test_mxfp8_both")
QUANTIZE_ONE = (
    "test_block_1x128",
    "test_block_128x128",
    "test_mxfp8",
    "test_nvfp4",
    "test_nvfp4_16x16",
)
CAST = "test_plain_cast"

MICRO = [
    Row("`with fc.autocast(recipe=r): pass`", ["test_fc_autocast"]),
    Row(
        "... vs empty `__slots__` context manager ({test_empty_slots_cm})",
        ratios=[("test_fc_autocast", "test_empty_slots_cm")],
        target=("<= 2x", [2.0]),
    ),
    Row(
        "... the same in pytest's context, which holds one more context variable "
        "({test_fc_autocast_in_pytest_context})",
        ratios=[("test_fc_autocast_in_pytest_context", "test_empty_slots_cm")],
    ),
    Row(
        "... the floor of per-context state: a manager that only sets and resets a "
        "context variable ({test_contextvar_cm})",
        ratios=[("test_contextvar_cm", "test_empty_slots_cm")],
    ),
    Row(
        "... vs `__slots__` context manager storing the same 4 arguments "
        "({test_slots_cm_storing_args})",
        ratios=[("test_fc_autocast", "test_slots_cm_storing_args")],
        target=("<= 2x", [2.0]),
    ),
    Row(
        '... vs `torch.autocast("cpu")` ({test_torch_autocast_cpu})',
        ratios=[("test_fc_autocast", "test_torch_autocast_cpu")],
        target=("<= 0.25x", [0.25]),
    ),
    Row(
        "... vs `@contextmanager` generator ({test_contextmanager_generator})",
        ratios=[("test_fc_autocast", "test_contextmanager_generator")],
    ),
    Row(
        "two nested levels vs one level, same / two recipes",
        ["test_fc_autocast_nested_same_recipe", "test_fc_autocast_nested_two_recipes"],
        [
            ("test_fc_autocast_nested_same_recipe", "test_fc_autocast"),
            ("test_fc_autocast_nested_two_recipes", "test_fc_autocast"),
        ],
        ("<= 2x", [2.0]),
    ),
    Row(
        "`fc.Linear` 16x16 fwd+bwd outside autocast vs `nn.Linear` ({test_nn_linear})",
        ["test_fc_linear_outside_autocast"],
        [("test_fc_linear_outside_autocast", "test_nn_linear")],
        ("<= 1.2x", [1.2]),
    ),
    Row(
        "`fc.Linear` 16x16 fwd+bwd, `Float8CurrentScaling`, vs `nn.Linear`",
        ["test_fc_linear_current"],
        [("test_fc_linear_current", "test_nn_linear")],
        ("<= 2.5x", [2.5]),
    ),
    Row(
        "... vs torchao `Float8Linear` ({test_torchao_float8_linear})",
        ratios=[("test_fc_linear_current", "test_torchao_float8_linear")],
        target=("<= 0.25x", [0.25]),
    ),
    OpsRow(
        "... ATen operations dispatched per fwd+bwd (`nn.Linear`: {ops:test_nn_linear}, "
        "torchao: {ops:test_torchao_float8_linear})",
        "test_fc_linear_current",
        25,
    ),
    Row(
        "`fc.Linear` fwd+bwd, `DelayedScaling`, vs `nn.Linear`",
        ["test_fc_linear_delayed"],
        [("test_fc_linear_delayed", "test_nn_linear")],
        ops=True,
    ),
    Row(
        "... vs the same under `Float8CurrentScaling`",
        ratios=[("test_fc_linear_delayed", "test_fc_linear_current")],
        target=("<= 1.2x", [1.2]),
    ),
    Row(
        "quantize 4096x4096 FP32 vs a plain `.to(float8_e4m3fn)` ({test_plain_cast}), per-tensor",
        ["test_current_scaling"],
        [("test_current_scaling", CAST)],
        ("<= 1.5x", [1.5]),
    ),
    Row(
        "... both layouts: per-tensor / 1x128 / MXFP8",
        QUANTIZE_BOTH,
        [(n, CAST) for n in QUANTIZE_BOTH],
        ("<= 1.5x / 2.5x", [1.5, 2.5, 2.5]),
    ),
    Row(
        "... 1x128 / 128x128 / MXFP8 / NVFP4 1x16 / NVFP4 16x16",
        QUANTIZE_ONE,
        [(n, CAST) for n in QUANTIZE_ONE],
        ("<= 2.5x", [2.5]),
    ),
    Row(
        "... row-wise, one / both layouts",
        ["test_rowwise", "test_rowwise_both"],
        [("test_rowwise", CAST), ("test_rowwise_both", CAST)],
        ("<= 2.5x", [2.5]),
    ),
]


# --------------------------------------------------------------------------- tables


def _md(headers: Sequence[str], align: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def line(cells: Sequence[str]) -> str:  # an empty cell is written "| |"
        return " ".join(["|", *(f"{c} |" if c else "|" for c in cells)])

    return [line(headers), line(align), *(line(r) for r in rows)]


def micro_table(get: Lookup) -> list[str]:
    rows = [row.cells(get) for row in MICRO]
    return _md(["what", "median", "ratio", "target"], ["---", "---:", "---:", "---"], rows)


# README's few rows: what a user compares first (MICRO's rows, by position).
HEADLINE_ROWS = (0, 1, 2, 5, 9, 10, 11, 14)


def headline_table(get: Lookup) -> list[str]:
    rows = [MICRO[i].cells(get) for i in HEADLINE_ROWS]
    return _md(["what", "median", "ratio", "target"], ["---", "---:", "---:", "---"], rows)


CHECKPOINT_COLUMNS = [
    ("torch.save", "checkpoint-save-torch", "test_save_torch"),
    ("torch.load (mmap)", "checkpoint-load-torch", "test_load_torch"),
    ("safetensors save", "checkpoint-save-safetensors", "test_save_safetensors"),
    ("safetensors load", "checkpoint-load-safetensors", "test_load_safetensors"),
]
CHECKPOINT_ROWS = [
    ("nn", "`nn.Linear`"),
    ("fc", "`fc.Linear`, stateless"),
    ("fc_delayed", "`fc.Linear`, delayed state"),
]


def checkpoint_table(get: Lookup) -> list[str]:
    rows = []
    for variant, label in CHECKPOINT_ROWS:
        row = [label]
        for _, _, test in CHECKPOINT_COLUMNS:
            median = get(f"{test}[{variant}]").median
            base = get(f"{test}[nn]").median
            row.append(format_time(median) if variant == "nn" else format_ratio(median / base))
        size = get(f"test_save_torch[{variant}]").extra["bytes"]
        base_size = get("test_save_torch[nn]").extra["bytes"]
        row.append(f"{size / 1e6:.1f} MB" if variant == "nn" else format_ratio(size / base_size))
        rows.append(row)
    headers = ["", *(c[0] for c in CHECKPOINT_COLUMNS), "file size"]
    return _md(headers, ["---", *["---:"] * (len(headers) - 1)], rows)


def _us(value: float) -> str:
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def overhead_table(overhead: dict) -> list[str]:
    kernel = "kernel µs/call" if overhead["device"] == "cuda" else "ATen µs/call"
    rows = [
        [
            f"`{r['range']}`",
            f"{r['calls_per_step']:g}",
            _us(r["cpu_us_per_call"]),
            _us(r["kernel_us_per_call"]),
            "" if r["cpu_over_kernel"] is None else f"{r['cpu_over_kernel']:.2f}x",
        ]
        for r in overhead["ranges"]
    ]
    s = overhead["step"]
    rows.append(
        [
            "whole step",
            "1",
            _us(s["cpu_us"]),
            _us(s["kernel_us"]),
            "" if s["cpu_over_kernel"] is None else f"{s['cpu_over_kernel']:.2f}x",
        ]
    )
    headers = ["range", "calls/step", "CPU µs/call", kernel, "CPU/kernel"]
    return _md(headers, ["---", "---:", "---:", "---:", "---:"], rows)


# Training-step rows: bench.train_step's recipe names, as README names them.
RECIPE_LABELS = {
    "fp32": "fp32",
    "bf16": "bf16 (`torch.autocast`)",
    "delayed": "`DelayedScaling`",
    "current": "`Float8CurrentScaling`",
    "block": "`Float8BlockScaling`",
    "mxfp8": "`MXFP8BlockScaling`",
    "nvfp4": "`NVFP4BlockScaling` (head kept)",
    "rowwise": "`Float8RowwiseScaling`",
    "rowwise_with_gw_hp": "... `wgrad_high_precision=True`",
    "torchao": "torchao float8",
}
# Issue 12: each FP8 recipe's eager step within 1.5x the FP32 step (NVFP4 is FP4).
STEP_TARGET = 1.5
FP8_RECIPES = ("delayed", "current", "block", "mxfp8", "rowwise", "rowwise_with_gw_hp")


def _ratio_cell(ratio: float | None, target: float | None, within: bool = False) -> str:
    """``1.18x: pass`` (``<= target``), or ``1.011: pass (3%)`` with ``within`` (a loss
    ratio within ``target`` of 1); no verdict without a target."""
    if ratio is None:
        return "n/a"
    if within:
        cell = f"{ratio:.3f}"
        if target is None:
            return cell
        ok = abs(ratio - 1.0) <= target
        return f"{cell}: {'pass' if ok else '**miss**'} ({target:.0%})"
    cell = f"{ratio:.2f}x"
    if target is None:
        return cell
    return f"{cell}: {'pass' if ratio <= target else '**miss**'}"


def _in_order(results: dict) -> dict:
    """``results`` in bench.train_step's order of recipes (the sample's JSON sorts keys)."""
    order = [name for name in RECIPE_LABELS if name in results]
    return {name: results[name] for name in order + sorted(set(results) - set(order))}


def train_step_table(run: dict) -> list[str]:
    """Eager training steps: step time and losses against the FP32 run."""
    results = _in_order(run["results"])
    ref = results.get("fp32") or results.get("bf16")
    rows = []
    for name, r in results.items():
        step_ratio = r["step_ms"] / ref["step_ms"] if ref else None
        is_ref = r is ref
        rows.append(
            [
                RECIPE_LABELS.get(name, name),
                f"{r['step_ms']:.1f} ms",
                _ratio_cell(step_ratio, STEP_TARGET if name in FP8_RECIPES else None),
                f"{r['final_loss']:.4f}",
                _ratio_cell(r["loss_ratio"], None, within=True),
                f"{r['heldout_loss']:.4f}",
                _ratio_cell(r["heldout_ratio"], None if is_ref else r["heldout_target"], True),
            ]
        )
    for name, reason in run.get("skipped", {}).items():
        rows.append([RECIPE_LABELS.get(name, name), "skipped", "", "", "", "", reason])
    headers = ["recipe", "step", "vs fp32 step", "final loss", "vs fp32"]
    headers += ["held-out loss", "vs fp32 held-out"]
    return _md(headers, ["---", *["---:"] * 6], rows)


def train_compile_table(run: dict) -> list[str]:
    """Eager against compiled training steps, compile times; current vs torchao."""
    results = _in_order(run["results"])
    rows = []
    for name, r in results.items():
        ratio = r["compiled_ms"] / r["eager_ms"]
        rows.append(
            [
                RECIPE_LABELS.get(name, name),
                f"{r['eager_ms']:.1f} ms",
                f"{r['compiled_ms']:.1f} ms",
                f"{ratio:.2f}x",
                f"{r['compile_cold_s']:.1f} / {r['compile_warm_s']:.1f} s",
            ]
        )
    for name, reason in run.get("not_run", {}).items():
        rows.append([RECIPE_LABELS.get(name, name), "", reason, "", ""])
    headers = ["recipe", "eager", "compiled", "compiled / eager", "compile cold / warm"]
    lines = _md(headers, ["---", "---:", "---:", "---:", "---:"], rows)
    if "current" in results and "torchao" in results:
        ratio = results["current"]["compiled_ms"] / results["torchao"]["compiled_ms"]
        verdict = "pass" if ratio <= 1.0 else "**miss**"
        lines += [
            "",
            f"Compiled current scaling / compiled torchao: {ratio:.2f}x ({verdict}, target <= 1x).",
        ]
    return lines


# --------------------------------------------------------------------------- rendering


def tables(sample: dict) -> dict[str, list[str]]:
    """Every block's lines, from a sample result."""
    entries = {e.name: e for e in (Entry(b) for b in sample.get("benchmarks", []))}

    def get(name: str) -> Entry:
        try:
            return entries[name]
        except KeyError:
            raise KeyError(f"bench.readme: the sample has no benchmark {name!r}") from None

    blocks = {
        "headline": headline_table(get),
        "micro": micro_table(get),
        "checkpoint": checkpoint_table(get),
    }
    extra = sample.get("fastcast") or {}
    if extra.get("overhead"):
        blocks["overhead"] = overhead_table(extra["overhead"])
    if extra.get("train_step"):
        blocks["train_step"] = train_step_table(extra["train_step"])
    if extra.get("train_step_compile"):
        blocks["train_compile"] = train_compile_table(extra["train_step_compile"])
    return blocks


BLOCK = re.compile(r"(<!-- bench:(\w+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def render(text: str, sample: dict) -> str:
    """``text`` with each marked block replaced by its table (unknown blocks kept)."""
    blocks = tables(sample)

    def replace(m: re.Match[str]) -> str:
        lines = blocks.get(m[2])
        if lines is None:
            return m[0]
        return m[1] + "\n".join(lines) + "\n" + m[4]

    return BLOCK.sub(replace, text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.readme", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
    p.add_argument("--sample", type=Path, default=SAMPLE)
    p.add_argument("--readme", type=Path, action="append", help="a page (default: README, docs)")
    args = p.parse_args(argv)
    sample = json.loads(args.sample.read_text())
    stale = 0
    for page in args.readme or PAGES:
        text = page.read_text()
        new = render(text, sample)
        names = [m[2] for m in BLOCK.finditer(text)]
        if args.check:
            if new != text:
                print(f"{page.name} is not what {args.sample.name} renders: run `make readme`")
                stale = 1
            else:
                print(f"{page.name} is up to date ({', '.join(names)})")
            continue
        if new != text:
            page.write_text(new)
        print(f"rendered {', '.join(names) or 'no blocks'} in {page.name}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
