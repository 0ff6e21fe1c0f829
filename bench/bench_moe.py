"""Mixture-of-experts experts, forward and backward: fastcast's grouped GEMM per recipe
against the transformers 5 implementations in high precision (``eager``: a loop over
the experts hit; ``grouped_mm``: ``torch._grouped_mm``).

One ``Qwen3MoeExperts`` (8 experts, top-2, hidden 256, expert intermediate 256) on 256
tokens with a fixed random routing; each entry times one forward and backward (``INNER``
per timed call) and records the ATen operations one iteration dispatches
(``aten_ops``). On the CPU fastcast emulates the grouped GEMM (quantize, dequantize,
``torch._grouped_mm`` in FP32), so its times there measure the emulation's cost, not a
speed-up; ``torch._scaled_grouped_mm`` runs on sm90/sm100 GPUs.

``make bench`` runs it with the other suites (pytest-benchmark); ``python -m
bench.bench_moe`` prints the same comparison as a table without pytest-benchmark.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastcast as fc

INNER = 2
TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 256, 256, 256, 8, 2
GROUP = "moe-experts"

RECIPES: dict[str, fc.Recipe] = {
    "current": fc.Float8CurrentScaling(),
    "delayed": fc.DelayedScaling(),
    "rowwise": fc.Float8RowwiseScaling(),
    "block": fc.Float8BlockScaling(),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(),
}

TARGETS = [
    (
        GROUP,
        "test_fastcast_outside_autocast",
        "test_transformers[grouped_mm]",
        1.1,
        "converted experts outside fc.autocast / transformers grouped_mm",
    ),
]

pytestmark = pytest.mark.usefixtures("single_thread")


def _experts(implementation: str):
    from transformers import Qwen3MoeConfig  # noqa: PLC0415 - an optional dependency
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: PLC0415

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    config._experts_implementation = implementation
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.05)
    return experts


def _routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(TOKENS, HIDDEN, generator=gen).requires_grad_()
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    weights, index = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    return h, index, weights


def _loop(experts, recipe: fc.Recipe | None) -> Callable[[], None]:
    h, index, weights = _routing()
    params = list(experts.parameters())

    def loop() -> None:
        for _ in range(INNER):
            with fc.autocast(recipe=recipe, enabled=recipe is not None):
                out = experts(h, index, weights)
            out.sum().backward()
            h.grad = None
            for p in params:
                p.grad = None

    return loop


def entries() -> dict[str, Callable[[], None]]:
    """Name -> loop of ``INNER`` forward+backward iterations, for every entry."""
    out = {f"transformers[{impl}]": _loop(_experts(impl), None) for impl in ("eager", "grouped_mm")}
    converted = fc.convert(_experts("grouped_mm"))
    out["fastcast_outside_autocast"] = _loop(converted, None)
    for name, recipe in RECIPES.items():
        out[f"fastcast[{name}]"] = _loop(converted, recipe)
    return out


class _CountOps(TorchDispatchMode):
    """Counts the ATen operations dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(loop: Callable[[], None]) -> float:
    with _CountOps() as ops:
        loop()
    return ops.count / INNER


def _run(benchmark, loop: Callable[[], None]) -> None:
    pytest.importorskip("transformers")
    benchmark.group = GROUP
    benchmark.extra_info["inner"] = INNER
    loop()  # plans, caches and kernels outside the timing
    benchmark.extra_info["aten_ops"] = count_ops(loop)
    benchmark(loop)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_transformers(benchmark, impl):
    pytest.importorskip("transformers")
    _run(benchmark, _loop(_experts(impl), None))


def test_fastcast_outside_autocast(benchmark):
    pytest.importorskip("transformers")
    _run(benchmark, _loop(fc.convert(_experts("grouped_mm")), None))


@pytest.mark.parametrize("name", list(RECIPES))
def test_fastcast(benchmark, name):
    pytest.importorskip("transformers")
    _run(benchmark, _loop(fc.convert(_experts("grouped_mm")), RECIPES[name]))


def main(repeats: int = 15) -> None:
    """Print median time per fwd+bwd and ATen ops per entry, against grouped_mm."""
    torch.set_num_threads(1)
    loops = entries()
    rows = []
    for name, loop in loops.items():
        loop()
        ops = count_ops(loop)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            loop()
            times.append((time.perf_counter() - start) / INNER)
        rows.append((name, statistics.median(times), ops))
    reference = dict((n, t) for n, t, _ in rows)["transformers[grouped_mm]"]
    print(
        f"Qwen3MoeExperts E={EXPERTS} top-{TOP_K} hidden={HIDDEN} intermediate={INTERMEDIATE} "
        f"tokens={TOKENS}, fwd+bwd, 1 thread, torch {torch.__version__}, "
        f"device {'cuda' if torch.cuda.is_available() else 'cpu'}"
    )
    print(f"{'entry':34} {'median ms':>10} {'vs grouped_mm':>14} {'ATen ops':>9}")
    for name, t, ops in rows:
        print(f"{name:34} {t * 1e3:10.2f} {t / reference:13.2f}x {ops:9.0f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
