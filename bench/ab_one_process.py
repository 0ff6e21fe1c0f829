"""Interleaved A/B in one process: this checkout's ``fastcast`` against another checkout's,
imported beside it under the name ``fcbase``.

``python bench/ab_one_process.py BASE_ROOT [rounds] [--traced]`` copies
``BASE_ROOT/fastcast`` to a temporary directory as ``fcbase`` (its absolute module,
operator and kernel-library names renamed: it builds its own kernels on first use, about
100 s once, then cached, and uses its own ``runtime/_native`` when it has one), then
times ``fc.autocast`` enter+exit and ``fc.Linear`` forward+backward (16x16 and 256x256,
current and delayed scaling) and ``fc.GroupedLinear``'s (8 experts of 128x128, 32 tokens
each, current scaling): each round one block per side and entry, A then B, the order
reversed the next round (``--traced``: with each side's ``fc.profiling`` ranges on
during its blocks). It prints per entry the medians of the blocks, B/A, the median (and
quartiles) of each round's B/A, and each side's min..max. One process: both sides see
the same allocator, caches and load; a shared machine still moves each block, so read
the spread before the ratio.
"""

from __future__ import annotations

import contextvars
import importlib
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]


def _copy_base(base_root: Path, into: Path) -> None:
    """``base_root/fastcast`` as the package ``fcbase`` under ``into``."""
    dst = into / "fcbase"
    shutil.copytree(
        base_root / "fastcast", dst, ignore=shutil.ignore_patterns("__pycache__", "installed")
    )
    renames = {
        '"fastcast.compile"': '"fcbase.compile"',
        '"fastcast.autocast"': '"fcbase.autocast"',
        '"fastcast::': '"fcbase::',  # its own torch.library operators
        # and its own kernel library (built on first use from its sources, under its own
        # key): the two checkouts' C++ operators may differ, and a namespace loads once
        "fastcast_kernels": "fcbase_kernels",
    }
    for path in dst.rglob("*"):
        if path.suffix not in (".py", ".cpp", ".h", ".cu", ".cuh"):
            continue
        text = path.read_text()
        new = text
        for old, replacement in renames.items():
            new = new.replace(old, replacement)
        if new != text:
            path.write_text(new)


def _block(loop: Any, inner: int, ranges: Any = None) -> float:
    """µs per iteration of ``loop``; with ``ranges`` (a package's ``fc.profiling``), its
    ranges on during the block."""
    if ranges is not None:
        ranges.enable()
    try:
        start = time.perf_counter()
        loop(inner)
        return (time.perf_counter() - start) / inner * 1e6
    finally:
        if ranges is not None:
            ranges.disable()


def _entries(fc: Any) -> dict[str, tuple[Any, int]]:
    """Entry name -> (loop(n), iterations a block)."""
    import torch  # noqa: PLC0415

    def autocast_loop(n: int) -> None:
        recipe, ac = fc.Float8CurrentScaling(), fc.autocast
        for _ in range(n):
            with ac(recipe=recipe):
                pass

    def linear(recipe: Any, size: int) -> Any:
        torch.manual_seed(0)
        layer = fc.Linear(size, size)
        x = torch.randn(size, size, requires_grad=True)

        def loop(n: int) -> None:
            for _ in range(n):
                with fc.autocast(recipe=recipe):
                    out = layer(x)
                out.sum().backward()
                x.grad = layer.weight.grad = layer.bias.grad = None

        loop(20)  # warm: plans, weight cache, delayed state
        return loop

    def grouped(recipe: Any) -> Any:
        torch.manual_seed(0)
        experts, size, tokens = 8, 128, 256  # 32 tokens per expert
        layer = fc.GroupedLinear(experts, size, size)
        x = torch.randn(tokens, size, requires_grad=True)
        offs = torch.arange(1, experts + 1, dtype=torch.int32) * (tokens // experts)

        def loop(n: int) -> None:
            for _ in range(n):
                with fc.autocast(recipe=recipe):
                    out = layer(x, offs)
                out.sum().backward()
                x.grad = layer.weight.grad = None

        loop(5)
        return loop

    fresh = contextvars.Context()  # a training script's context (docs/architecture.md)
    out = {"autocast enter+exit": (lambda n: fresh.run(autocast_loop, n), 5000)}
    for size, inner in ((16, 100), (256, 20)):
        for name, recipe in (
            ("current", fc.Float8CurrentScaling()),
            ("delayed", fc.DelayedScaling()),
        ):
            out[f"Linear {size}x{size} fwd+bwd {name}"] = (linear(recipe, size), inner)
    out["GroupedLinear 8x128 fwd+bwd current"] = (grouped(fc.Float8CurrentScaling()), 10)
    return out


def main(argv: list[str]) -> int:
    traced = "--traced" in argv  # each side's fc.profiling ranges on while it is timed
    argv = [a for a in argv if a != "--traced"]
    base_root, rounds = Path(argv[0]).resolve(), int(argv[1]) if len(argv) > 1 else 15
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        _copy_base(base_root, Path(tmp))
        sys.path.insert(0, str(HERE))
        sys.path.insert(0, tmp)
        base, this = importlib.import_module("fcbase"), importlib.import_module("fastcast")
        assert Path(this.__file__).is_relative_to(HERE), this.__file__
        sides = {"A (base)": _entries(base), "B (this)": _entries(this)}
        packages = {"A (base)": base, "B (this)": this}
        names = list(sides["A (base)"])
        times: dict[str, dict[str, list[float]]] = {s: {n: [] for n in names} for s in sides}
        order = list(sides)
        for i in range(rounds):
            for name in names:
                for side in order if i % 2 == 0 else order[::-1]:
                    loop, inner = sides[side][name]
                    ranges = packages[side].profiling if traced else None
                    times[side][name].append(_block(loop, inner, ranges))
    print(
        f"A: {base_root}  B: {HERE}  rounds: {rounds}  (µs per iteration)"
        + ("  fc.profiling ranges on" if traced else "")
    )
    print(
        f"{'entry':34} {'A median':>9} {'B median':>9} {'B/A':>6}  {'paired B/A (IQR)':>22}"
        "   A min..max   B min..max"
    )
    for name in names:
        a, b = times["A (base)"][name], times["B (this)"][name]
        ma, mb = statistics.median(a), statistics.median(b)
        # Each round's B/A: the two blocks of a round ran side by side, under one load.
        paired = sorted(y / x for x, y in zip(a, b))
        q1, q2, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        print(
            f"{name:34} {ma:9.2f} {mb:9.2f} {mb / ma:6.3f}  {q2:8.3f} ({q1:.3f}..{q3:.3f})"
            f"   {min(a):.1f}..{max(a):.1f}   {min(b):.1f}..{max(b):.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
