"""What ``fc.inspect`` costs the eager ``fc.Linear`` forward+backward: an A/B in one process.

``python -m bench.inspect_overhead [--rounds 15 --inner 200]`` times bench/bench_linear.py's
loop (one ``[16, 16]`` layer, current scaling, forward inside ``fc.autocast``, backward
outside, gradients set to None) per iteration, in interleaved rounds of four states:

- ``never``: no inspection was ever created;
- ``off``: an inspection was started, ran sampled steps, and was stopped (what "free when
  off" promises: the same code runs as in ``never``);
- ``on, skipped step``: an inspection is on, ``every`` large, in a step it does not sample
  (its layer observer runs once per layer call and returns the layer's plan as it is);
- ``on, sampled step``: every step is sampled (taps record statistics of every operand).

It prints the median per-iteration time of each state and its ratio to ``never``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

import fastcast as fc

SIZE = 16


def _loop(layer: fc.Linear, x: torch.Tensor, recipe: fc.Recipe, inner: int) -> float:
    """Seconds per iteration of ``inner`` training iterations (bench_linear's loop)."""
    params = [x, layer.weight, layer.bias]
    start = time.perf_counter()
    for _ in range(inner):
        with fc.autocast(recipe=recipe):
            out = layer(x)
        out.sum().backward()
        for p in params:
            p.grad = None
    return (time.perf_counter() - start) / inner


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = fc.Linear(SIZE, SIZE)
    x = torch.randn(SIZE, SIZE, requires_grad=True)
    recipe = fc.Float8CurrentScaling()

    def never() -> float:
        return _loop(layer, x, recipe, args.inner)

    def off() -> float:  # stopped inspections leave nothing behind
        return _loop(layer, x, recipe, args.inner)

    def skipped() -> float:
        insp = fc.inspect(layer, every=10**9).start()
        _loop(layer, x, recipe, 1)  # step 0 (sampled) runs untimed
        try:
            return _loop(layer, x, recipe, args.inner)
        finally:
            insp.stop()

    def sampled() -> float:
        insp = fc.inspect(layer, every=1).start()
        try:
            return _loop(layer, x, recipe, max(1, args.inner // 10))
        finally:
            insp.stop()

    from fastcast.nn import linear  # noqa: PLC0415 - what an inspection must leave as it was
    from fastcast.runtime import observers  # noqa: PLC0415 - where its observer is attached

    _loop(layer, x, recipe, 20)  # warm-up: plans, kernels
    originals = (
        linear.plan_for,
        fc.autocast.__dict__["__enter__"],
        layer._plan.input_q,
        tuple(observers.attached),
    )
    times: dict[str, list[float]] = {"never": [], "off": [], "skipped": [], "sampled": []}
    # Phase 1: no inspection has existed in this process yet.
    for _ in range(args.rounds):
        times["never"].append(never())
    sampled()  # an inspection ran (sampling every step) and stopped
    restored = originals == (
        linear.plan_for,
        fc.autocast.__dict__["__enter__"],
        layer._plan.input_q,
        tuple(observers.attached),
    )
    # Phase 2: off again (the same code as phase 1, if stop() put everything back), and
    # inspections on, interleaved round by round.
    for _ in range(args.rounds):
        times["off"].append(off())
        times["skipped"].append(skipped())
        times["sampled"].append(sampled())
    base = statistics.median(times["never"])
    labels = {
        "never": "never on",
        "off": "off after a run",
        "skipped": "on, skipped step",
        "sampled": "on, sampled step",
    }
    print(f"fc.Linear fwd+bwd [{SIZE}x{SIZE}], current scaling, median of {args.rounds} rounds")
    print(
        "  after stop(): plan_for, autocast.__enter__, the quantizers and the (empty) observer "
        f"list are as before: {restored}"
    )
    for name, label in labels.items():
        median = statistics.median(times[name])
        print(f"  {label:18s} {median * 1e6:9.1f} us/iter  {median / base:6.3f}x never on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
