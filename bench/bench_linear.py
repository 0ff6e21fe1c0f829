"""Eager ``fc.Linear`` forward+backward on tiny, overhead-bound shapes, against peers.

Every timed function runs ``INNER`` training iterations of one layer on one input:
``out = layer(x); out.sum().backward()`` (the forward inside ``fc.autocast`` for the
quantized fastcast entries, with the recipe built once; the backward outside it, as
users write it), then sets the gradients of the input, the weight and the bias to
``None``, as ``optimizer.zero_grad()`` does. All entries share that loop shape, so the
per-iteration times differ only by the layer (and by the autocast it needs).

The shapes are tiny (``[16, 16]``, or ``[32, 32]`` for MXFP8, whose 32-element blocks
need it), so the GEMMs cost next to nothing and the times measure CPU overhead: Python
and the number of tensor operations dispatched. torchao's ``Float8Linear`` (tensorwise
dynamic scaling, the recipe ``Float8CurrentScaling`` also implements) is skipped when
torchao is not installed. The module runs on one intra-op thread (restored afterwards):
the pool cannot speed up such shapes, only add stalls where cores are shared. Each
entry also records the ATen operations one iteration dispatches (``aten_ops``, counted
by a ``TorchDispatchMode`` in an untimed run; a fused operator counts as one), the loss's
``sum`` and its backward included.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fastcast as fc

INNER = 20
SMALL = 16
MX = 32  # MXFP8 blocks are 32 elements along K: the smallest shape it runs

GROUP = "linear-fwd-bwd"
GROUP_MX = "linear-fwd-bwd-32"

TARGETS = [
    (
        GROUP,
        "test_fc_linear_current",
        "test_nn_linear",
        2.5,
        "fc.Linear fwd+bwd (current scaling) / nn.Linear",
    ),
    (
        GROUP,
        "test_fc_linear_current",
        "test_torchao_float8_linear",
        0.25,
        "fc.Linear fwd+bwd (current scaling) / torchao Float8Linear",
    ),
    (
        GROUP,
        "test_fc_linear_current",
        None,
        25,
        "fc.Linear fwd+bwd (current scaling): ATen ops per iteration",
        "aten_ops",
    ),
    (
        GROUP,
        "test_fc_linear_delayed",
        "test_fc_linear_current",
        1.2,
        "fc.Linear fwd+bwd, delayed scaling / current scaling",
    ),
    (
        GROUP,
        "test_fc_linear_delayed",
        None,
        25,
        "fc.Linear fwd+bwd (delayed scaling): ATen ops per iteration",
        "aten_ops",
    ),
    (
        GROUP,
        "test_fc_linear_outside_autocast",
        "test_nn_linear",
        1.2,
        "fc.Linear fwd+bwd outside autocast / nn.Linear",
    ),
]


pytestmark = pytest.mark.usefixtures("single_thread")


def _input(size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(size, size, generator=gen).requires_grad_()


def _seeded(make):
    """Build a layer with the same initial weights whatever else ran before."""
    torch.manual_seed(0)
    return make()


def _params(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    weight, bias = list(layer.parameters())
    return weight, bias


def _plain_loop(layer: nn.Module, x: torch.Tensor):
    """``INNER`` forward+backward iterations with no autocast."""
    w, b = _params(layer)

    def loop():
        for _ in range(INNER):
            out = layer(x)
            out.sum().backward()
            x.grad = None
            w.grad = None
            b.grad = None

    return loop


def _autocast_loop(layer: nn.Module, x: torch.Tensor, recipe: fc.Recipe):
    """``INNER`` iterations with the forward inside ``fc.autocast(recipe=recipe)``."""
    w, b = _params(layer)
    cm = fc.autocast

    def loop():
        for _ in range(INNER):
            with cm(recipe=recipe):
                out = layer(x)
            out.sum().backward()
            x.grad = None
            w.grad = None
            b.grad = None

    return loop


class _CountOps(TorchDispatchMode):
    """Counts the ATen operations dispatched (a fused operator counts as one)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _run(benchmark, group: str, loop) -> None:
    benchmark.group = group
    benchmark.extra_info["inner"] = INNER
    loop()  # first call builds plans and caches outside the timing
    with _CountOps() as ops:  # the same loop, untimed: what one iteration dispatches
        loop()
    benchmark.extra_info["aten_ops"] = ops.count / INNER
    benchmark(loop)
    assert not fc.is_autocast_enabled() and fc.get_autocast_recipe() is None


# --------------------------------------------------------------------------- [16, 16]


def test_nn_linear(benchmark):
    layer = _seeded(lambda: nn.Linear(SMALL, SMALL))
    _run(benchmark, GROUP, _plain_loop(layer, _input(SMALL)))


def test_fc_linear_outside_autocast(benchmark):
    layer = _seeded(lambda: fc.Linear(SMALL, SMALL))
    _run(benchmark, GROUP, _plain_loop(layer, _input(SMALL)))


def test_fc_linear_current(benchmark):
    layer = _seeded(lambda: fc.Linear(SMALL, SMALL))
    recipe = fc.Float8CurrentScaling()
    _run(benchmark, GROUP, _autocast_loop(layer, _input(SMALL), recipe))


def test_fc_linear_current_traced(benchmark):
    """The same as test_fc_linear_current with fastcast's ranges on (fc.profiling.enable():
    NVTX + record_function per range, no profiler attached): what tracing costs."""
    layer = _seeded(lambda: fc.Linear(SMALL, SMALL))
    recipe = fc.Float8CurrentScaling()
    fc.profiling.enable()
    try:
        _run(benchmark, GROUP, _autocast_loop(layer, _input(SMALL), recipe))
    finally:
        fc.profiling.disable()


def test_fc_linear_delayed(benchmark):
    layer = _seeded(lambda: fc.Linear(SMALL, SMALL))
    recipe = fc.DelayedScaling()
    _run(benchmark, GROUP, _autocast_loop(layer, _input(SMALL), recipe))


def test_torchao_float8_linear(benchmark):
    try:
        from torchao.float8 import convert_to_float8_training
    except Exception as exc:  # noqa: BLE001 - absent, or broken for this torch: skip either way
        pytest.skip(f"torchao.float8 is not importable: {exc}")
    model = _seeded(lambda: nn.Sequential(nn.Linear(SMALL, SMALL)))
    model = convert_to_float8_training(model)
    _run(benchmark, GROUP, _plain_loop(model, _input(SMALL)))


# --------------------------------------------------------------------------- [32, 32]


def test_nn_linear_32(benchmark):
    layer = _seeded(lambda: nn.Linear(MX, MX))
    _run(benchmark, GROUP_MX, _plain_loop(layer, _input(MX)))


def test_fc_linear_mxfp8_32(benchmark):
    layer = _seeded(lambda: fc.Linear(MX, MX))
    recipe = fc.MXFP8BlockScaling()
    _run(benchmark, GROUP_MX, _autocast_loop(layer, _input(MX), recipe))
