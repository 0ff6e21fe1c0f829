"""Numerics inspection of the training-step benchmark, per recipe: ``fc.inspect``'s report.

``python -m bench.inspect_report [--steps 60 --every 5 --out profiles/numerics ...]``
trains bench/train_step.py's model (the same MLP stack, data, initial weights and AdamW;
NVFP4 keeps its head in high precision, as there) once per quantized recipe under
``fc.inspect(model, every=...)`` and writes, per recipe, ``<recipe>.md`` (the per-layer
table, worst first, and the actions) and ``<recipe>.png`` (the heatmap of ``rank_db``,
the lower of the whole tensor's SQNR and its bulk's, layers x steps), and ``summary.md``:
per recipe, the mean SQNR of each operand and layout over layers and sampled steps, and
the operand that limits the recipe (the lowest).
docs/numerics.md shows the committed outputs.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

import fastcast as fc
from bench.train_step import DEFAULTS, KEEP_HEAD, QUANTIZED, MLPStack, make_data

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "profiles" / "numerics"


def inspect_recipe(
    name: str,
    width: int = DEFAULTS["width"],
    depth: int = DEFAULTS["depth"],
    batch: int = DEFAULTS["batch"],
    steps: int = DEFAULTS["steps"],
    lr: float = DEFAULTS["lr"],
    seed: int = DEFAULTS["seed"],
    every: int = 5,
) -> fc.numerics.Report:
    """Train the benchmark model with recipe ``name`` under ``fc.inspect``; its report."""
    device = torch.device("cpu")
    torch.manual_seed(seed)
    model = MLPStack(width, depth)
    recipe = QUANTIZED[name]()
    keep = fc.keep_high_precision(model) if name in KEEP_HEAD else None
    fc.convert(model, keep, recipe=recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    inputs, targets = make_data(width, batch, steps, seed, device)
    with fc.inspect(model, every=every) as insp:
        for step in range(steps):
            with fc.autocast(recipe=recipe):
                out = model(inputs[step])
            F.mse_loss(out.float(), targets[step]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return insp.report()


def operand_means(report: fc.numerics.Report) -> dict[tuple[str, str, str], float]:
    """Mean SQNR (dB) per (operand, layout, format) over layers and steps."""
    sums: dict[tuple[str, str, str], list[float]] = {}
    for row in report.rows():
        if math.isfinite(row["sqnr_db"]):
            key = (row["operand"], row["layout"], row["fmt"])
            sums.setdefault(key, []).append(row["sqnr_db"])
    return {k: sum(v) / len(v) for k, v in sums.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key in ("width", "depth", "batch", "steps", "seed"):
        parser.add_argument(f"--{key}", type=int, default=DEFAULTS[key])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--every", type=int, default=5, help="sample every N steps")
    parser.add_argument("--recipes", nargs="+", default=list(QUANTIZED), choices=list(QUANTIZED))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.inspect_report " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    config = (
        f"width {args.width}, depth {args.depth}, batch {args.batch}, {args.steps} steps, "
        f"lr {args.lr}, seed {args.seed}, sampled every {args.every} steps; "
        f"{platform.machine()} CPU, torch {torch.__version__}"
    )
    summary = [
        "# fc.inspect on the training-step benchmark",
        "",
        f"`{command.strip()}` ({config}).",
        "",
        "Mean SQNR (dB) per operand and layout over layers and sampled steps; in bold the "
        "operand that limits the recipe (the lowest, when 1 dB or more below the best); "
        "flagged: layers with an SQNR below their format's threshold at some sampled step.",
        "",
        "| recipe | input row | input col | weight row | weight col | grad row | grad col | "
        "limiting operand | flagged layers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.recipes:
        start = time.perf_counter()
        report = inspect_recipe(
            name, args.width, args.depth, args.batch, args.steps, args.lr, args.seed, args.every
        )
        seconds = time.perf_counter() - start
        means = operand_means(report)
        worst = min(means, key=means.get)
        # An operand limits the recipe when it is clearly the lowest: 1 dB below the best.
        limiting = worst if max(means.values()) - means[worst] >= 1.0 else None
        cells = []
        for operand in fc.numerics.OPERANDS:
            for layout in fc.numerics.LAYOUTS:
                found = [(v, k[2]) for k, v in means.items() if k[:2] == (operand, layout)]
                if not found:
                    cells.append("-")
                    continue
                value, fmt = found[0]
                text = f"{value:.1f} ({fmt})"
                cells.append(f"**{text}**" if (operand, layout, fmt) == limiting else text)
        flagged = report.flagged()
        limit = "none (all within 1 dB)" if limiting is None else " ".join(limiting[:2])
        if limiting is not None:
            limit += f" ({limiting[2]})"
        summary.append(f"| {name} | {' | '.join(cells)} | {limit} | {len(flagged)} |")
        body = [
            f"# fc.inspect: {name} ({QUANTIZED[name]()!r})",
            "",
            f"`{command.strip()}` ({config}).",
            "",
            str(report),
            "",
        ]
        (args.out / f"{name}.md").write_text("\n".join(body))
        report.heatmap(
            args.out / f"{name}.png",
            title=f"{name}: SQNR (dB; whole or bulk, the lower) per layer operand and step",
        )
        print(f"{name}: {seconds:.1f} s, limiting operand: {limit}, {len(flagged)} flagged")
        print(report.table(limit=4))
        for action in report.actions():
            print("  -", action)
    (args.out / "summary.md").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
