"""Host time of an fc.Linear call on CUDA's routing, estimated on the CPU (issue 25 A).

On a GPU the quantize operators are Inductor-compiled functions: each call pays Dynamo's
guards and Inductor's wrapper before its kernel launches, ~20 µs of host time, where a
C++ operator pays ~1-3 µs. A small layer on an idle GPU is then host-bound: the step
takes as long as the CPU needs to launch its kernels. Two measurements, in one process:

1. Launches per fc.Linear forward+backward on a simulated sm90 (fake CUDA tensors, bf16,
   64x128 -> 256): compiled quantize/dequantize operators and ``torch._scaled_mm`` calls.
2. Host time per fwd+bwd at 32x32 on this CPU, where the kernels themselves cost next to
   nothing, for: ``nn.Linear``; ``fc.Linear`` on the C++ operators (the CPU path);
   ``fc.Linear`` with ``FASTCAST_KERNELS=compiled`` (every quantize through its own
   compiled function, as CUDA routes them: ~the eager CUDA layer's host cost); and the
   alternative design, the whole layer call as one compiled region (``torch.compile`` of
   the call, fullgraph: one compiled forward and one compiled backward per call).

    PYTHONPATH=. python -m bench.cuda_host_estimate [--recipes current,rowwise]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import fastcast as fc
from fastcast.kernels import choice

RECIPES = {
    "current": fc.Float8CurrentScaling(),
    "rowwise": fc.Float8RowwiseScaling(),
    "block": fc.Float8BlockScaling(),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(),
}


def median_us(fn: Callable[[], object], calls: int = 300) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def launches(recipe: fc.Recipe) -> tuple[int, int]:
    """(compiled operators, torch._scaled_mm calls) per fwd+bwd on a simulated sm90."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fake_cuda import fake_parameters, on_fresh_thread, run_backward, simulated_cuda

    def body() -> tuple[int, int]:
        with simulated_cuda((9, 0)) as launched:
            layer = fake_parameters(fc.Linear(128, 256, dtype=torch.bfloat16))
            x = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with fc.autocast(recipe=recipe):
                y = layer(x)
            run_backward(y, torch.empty_like(y))
        return len(launched.compiled_ops), len(launched.scaled_mm)

    return on_fresh_thread(body)


def fwd_bwd(layer: nn.Module, x: torch.Tensor, recipe: fc.Recipe | None) -> Callable[[], None]:
    def run() -> None:
        if recipe is None:
            y = layer(x)
        else:
            with fc.autocast(recipe=recipe):
                y = layer(x)
        y.sum().backward()

    return run


def region(layer: nn.Module, x: torch.Tensor, recipe: fc.Recipe) -> Callable[[], None]:
    def call(inp: torch.Tensor) -> torch.Tensor:
        with fc.autocast(recipe=recipe):
            return layer(inp)

    compiled = torch.compile(call, fullgraph=True)

    def run() -> None:
        compiled(x).sum().backward()

    return run


def with_kernels(mode: str) -> None:
    os.environ["FASTCAST_KERNELS"] = mode
    choice.refresh()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--no-region", action="store_true", help="skip the compiled regions")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(32, 32, requires_grad=True)  # MXFP8 blocks are 32 wide
    base = median_us(fwd_bwd(nn.Linear(32, 32), x, None))
    print(f"nn.Linear 32x32 fwd+bwd: {base:.1f} us (host-bound on a GPU too)")
    head = "recipe   compiled ops  scaled_mm  C++ ops (CPU)  compiled ops (CUDA's)  one region"
    print(head)
    for name in args.recipes.split(","):
        recipe = RECIPES[name]
        ops, mms = launches(recipe)
        layer = fc.convert(nn.Linear(32, 32))
        with_kernels("fused")
        cpp = median_us(fwd_bwd(layer, x, recipe))
        with_kernels("compiled")
        per_op = median_us(fwd_bwd(layer, x, recipe), calls=100)
        whole = float("nan")
        if not args.no_region:
            with_kernels("auto")
            whole = median_us(region(layer, x, recipe), calls=100)
        del os.environ["FASTCAST_KERNELS"]
        choice.refresh()
        print(
            f"{name:8} {ops:>12} {mms:>10} {cpp:>10.1f} us ({cpp / base:.1f}x) "
            f"{per_op:>9.1f} us ({per_op / base:.1f}x) {whole:>8.1f} us ({whole / base:.1f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
