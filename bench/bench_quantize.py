"""Quantization throughput of each scaling family on a 4096x4096 FP32 matrix (CPU).

The reference is a plain saturation-free ``x.to(torch.float8_e4m3fn)`` (ATen's CPU
cast): one pass over the data. Every quantizer produces its row-wise layout, and the
``*_both`` entries both layouts (what an activation needs for the weight gradient). A
call takes milliseconds, so each entry runs a few rounds of one call
(``benchmark.pedantic``) rather than the runner's default round count.

Each entry records ``numel`` and, after timing, ``elements_per_s`` (numel / median) in
its extra info. Targets: per-tensor <= 1.5x the plain cast, every other family <= 2.5x
(fused kernels: ``fastcast.kernels``; ``FASTCAST_KERNELS=reference`` times the
reference).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from fastcast.quantizers.nvfp4 import NVFP4Quantizer
from fastcast.quantizers.tensorwise import CurrentScalingQuantizer

GROUP = "quantize-4096"
SIZE = 4096
ROUNDS = 5
TARGETS = [
    (GROUP, subject, "test_plain_cast", limit, f"{label} / plain FP8 cast")
    for subject, label, limit in (
        ("test_current_scaling", "per-tensor current scaling", 1.5),
        ("test_current_scaling_both", "per-tensor current scaling, both layouts", 1.5),
        ("test_block_1x128", "block scaling 1x128", 2.5),
        ("test_block_1x128_both", "block scaling 1x128, both layouts", 2.5),
        ("test_block_128x128", "block scaling 128x128", 2.5),
        ("test_mxfp8", "MXFP8", 2.5),
        ("test_mxfp8_both", "MXFP8, both layouts", 2.5),
        ("test_nvfp4", "NVFP4 1x16", 2.5),
        ("test_nvfp4_16x16", "NVFP4 16x16", 2.5),
        ("test_rowwise", "row-wise", 2.5),
        ("test_rowwise_both", "row-wise, both layouts", 2.5),
    )
]


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(SIZE, SIZE, generator=gen, dtype=torch.float32)


def _run(benchmark, fn, x: torch.Tensor) -> None:
    benchmark.group = GROUP
    benchmark.extra_info["numel"] = x.numel()
    benchmark.pedantic(fn, args=(x,), rounds=ROUNDS, iterations=1, warmup_rounds=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None when benchmarks are disabled
        benchmark.extra_info["elements_per_s"] = x.numel() / stats.stats.median


def _quantizer(module: str, name: str, **kwargs):
    """A quantizer from a family module that may not exist yet (the test then skips)."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"{module}.{name} is not available: {exc}")
    return cls(**kwargs)


def _rowwise(quantizer):
    return lambda x: quantizer.quantize(x, rowwise=True, columnwise=False)


def _both(quantizer):
    return lambda x: quantizer.quantize(x, rowwise=True, columnwise=True)


def test_plain_cast(benchmark, x):
    _run(benchmark, lambda x: x.to(torch.float8_e4m3fn), x)


def test_current_scaling(benchmark, x):
    _run(benchmark, _rowwise(CurrentScalingQuantizer()), x)


def test_current_scaling_both(benchmark, x):
    _run(benchmark, _both(CurrentScalingQuantizer()), x)


def test_block_1x128_both(benchmark, x):
    quantizer = _quantizer("fastcast.quantizers.block", "BlockScalingQuantizer", block_dim=1)
    _run(benchmark, _both(quantizer), x)


def test_mxfp8_both(benchmark, x):
    _run(benchmark, _both(_quantizer("fastcast.quantizers.mx", "MXFP8Quantizer")), x)


def test_block_1x128(benchmark, x):
    quantizer = _quantizer("fastcast.quantizers.block", "BlockScalingQuantizer", block_dim=1)
    _run(benchmark, _rowwise(quantizer), x)


def test_block_128x128(benchmark, x):
    quantizer = _quantizer("fastcast.quantizers.block", "BlockScalingQuantizer", block_dim=2)
    _run(benchmark, _rowwise(quantizer), x)


def test_mxfp8(benchmark, x):
    _run(benchmark, _rowwise(_quantizer("fastcast.quantizers.mx", "MXFP8Quantizer")), x)


def test_nvfp4(benchmark, x):
    _run(benchmark, _rowwise(NVFP4Quantizer()), x)


def test_nvfp4_16x16(benchmark, x):
    _run(benchmark, _rowwise(NVFP4Quantizer(block_2d=True)), x)


def test_rowwise(benchmark, x):
    _run(benchmark, _rowwise(_quantizer("fastcast.quantizers.rowwise", "RowwiseQuantizer")), x)


def test_rowwise_both(benchmark, x):
    _run(benchmark, _both(_quantizer("fastcast.quantizers.rowwise", "RowwiseQuantizer")), x)
