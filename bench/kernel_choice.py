"""Which per-tensor quantize implementation to use on CPU, by measurement.

Prints the median per-call time (and its ratio to a plain ``.to(float8_e4m3fn)``) of:
the PyTorch reference quantize; the same math compiled once by Inductor
(``torch.compile(dynamic=True)``, warm); an empty C++ operator called through
``torch.ops`` (the floor of dispatch); the fused C++ operator alone; and the quantizer
on the fused path (operator plus the Python that wraps its outputs). FP32 inputs,
16x16 (overhead-bound) and 4096x4096 (bandwidth-bound).

    PYTHONPATH=. python -m bench.kernel_choice
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from fastcast.kernels import build, choice
from fastcast.quantizers.tensorwise import CurrentScalingQuantizer

SIZES = {16: 2000, 4096: 15}  # side -> calls timed


def median_s(fn: Callable[[], object], calls: int) -> float:
    for _ in range(max(3, calls // 10)):  # warm-up
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def with_mode(mode: str, quantizer: CurrentScalingQuantizer) -> Callable:
    """The quantizer's row-wise quantize with FASTCAST_KERNELS forced to ``mode`` (the
    choice is resolved once per mode, then set before each call: no env read timed)."""
    os.environ["FASTCAST_KERNELS"] = mode
    choice.refresh()
    forced = choice._resolve_cpu()
    del os.environ["FASTCAST_KERNELS"]

    def run(x: torch.Tensor) -> object:
        choice._cpu_ops = forced
        return quantizer.quantize(x)

    return run


def main() -> None:
    torch.manual_seed(0)
    q = CurrentScalingQuantizer()
    reference = with_mode("reference", q)
    fused = with_mode("fused", q)
    op = torch.ops.fastcast_kernels.quantize_tensorwise.default
    noop = torch.ops.fastcast_kernels.noop.default
    e4m3 = torch.float8_e4m3fn

    def compiled_math(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = q.quantize(x)  # traced: the reference (tensorwise_op is None in a graph)
        return out.data, out.scale_inv

    compiled = torch.compile(compiled_math, dynamic=True)
    # The first load's time (build included): load() returns it once loaded.
    print(f"fused build/load on first use: {build.load():.2f} s")
    for side, calls in SIZES.items():
        x = torch.randn(side, side)
        start = time.perf_counter()
        compiled(x)
        first = time.perf_counter() - start
        rows = {
            "plain cast": lambda x=x: x.to(e4m3),
            "reference quantize": lambda x=x: reference(x),
            "inductor (same math)": lambda x=x: compiled(x),
            "empty C++ op": lambda x=x: noop(x),
            "fused C++ op": lambda x=x: op(x, None, e4m3, False, 0.0, True, False),
            "fused quantize": lambda x=x: fused(x),
        }
        times = {name: median_s(fn, calls) for name, fn in rows.items()}
        base = times["plain cast"]
        print(f"\n{side}x{side} FP32 (inductor first call {first:.1f} s)")
        for name, t in times.items():
            print(f"  {name:22s} {t * 1e6:10.1f} us  {t / base:6.2f}x plain cast")


if __name__ == "__main__":
    main()
