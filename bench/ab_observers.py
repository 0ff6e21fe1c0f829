"""Interleaved A/B of the observer points' cost when none is attached: ``fc.autocast``
enter+exit and ``fc.Linear`` forward+backward (16x16 and 256x256, current and delayed
scaling), the same timing script run alternately against two checkouts.

``python bench/ab_observers.py A_ROOT B_ROOT [rounds]`` prints per-entry medians over the
rounds (each round one fresh process per checkout, A then B then the reverse order next
round) and the spread (min..max) of each side. ``--one`` (internal) times one process.
"""

from __future__ import annotations

import contextvars
import json
import os
import statistics
import subprocess
import sys
import time
import warnings


def _median_time(loop, inner: int, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        loop(inner)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times) * 1e6


def _one() -> dict[str, float]:
    import torch  # noqa: PLC0415

    import fastcast as fc  # noqa: PLC0415

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    def autocast_loop(n: int) -> None:
        recipe, ac = fc.Float8CurrentScaling(), fc.autocast
        for _ in range(n):
            with ac(recipe=recipe):
                pass

    def linear(recipe, size: int):
        torch.manual_seed(0)
        layer = fc.Linear(size, size)
        x = torch.randn(size, size, requires_grad=True)

        def loop(n: int) -> None:
            for _ in range(n):
                with fc.autocast(recipe=recipe):
                    out = layer(x)
                out.sum().backward()
                x.grad = layer.weight.grad = layer.bias.grad = None

        loop(20)
        return loop

    out = {"autocast enter+exit": contextvars.Context().run(_median_time, autocast_loop, 20000)}
    for size, inner in ((16, 200), (256, 40)):
        for name, recipe in (
            ("current", fc.Float8CurrentScaling()),
            ("delayed", fc.DelayedScaling()),
        ):
            out[f"Linear {size}x{size} {name}"] = _median_time(linear(recipe, size), inner)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(json.dumps(_one()))
        return 0
    roots, rounds = argv[:2], int(argv[2]) if len(argv) > 2 else 5
    results: dict[str, list[dict[str, float]]] = {root: [] for root in roots}
    for i in range(rounds):
        for root in roots if i % 2 == 0 else roots[::-1]:
            env = dict(os.environ, PYTHONPATH=root)
            done = subprocess.run(
                [sys.executable, __file__, "--one"],
                env=env,
                cwd=root,
                capture_output=True,
                text=True,
                check=True,
            )
            results[root].append(json.loads(done.stdout.strip().splitlines()[-1]))
    a, b = roots
    print(
        f"{'us/iter (median of ' + str(rounds) + ' processes)':40s} {'A':>9s} {'B':>9s} {'B/A':>7s}"
        "   A min..max       B min..max"
    )
    for key in results[a][0]:
        va = [r[key] for r in results[a]]
        vb = [r[key] for r in results[b]]
        ma, mb = statistics.median(va), statistics.median(vb)
        print(
            f"{key:40s} {ma:9.2f} {mb:9.2f} {mb / ma:7.3f}   {min(va):6.2f}..{max(va):<8.2f}"
            f" {min(vb):6.2f}..{max(vb):.2f}"
        )
    print(f"A = {a}\nB = {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
