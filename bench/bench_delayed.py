"""The delayed-scaling update with N ``fc.Linear`` modules: its cost should not grow with N.

Each test builds N ``fc.Linear(16, 16)`` modules and runs one forward of each under
``fc.autocast(recipe=fc.DelayedScaling())`` (without grad, so that no backward is left
pending), which gives their forward amax histories columns in one slab of the thread's
delayed-scaling registry. The timed function is only the forward update, as the
outermost autocast's exit runs it: mark the forward slab pending, then
``DelayedState.end(FORWARD)`` of the thread's own owner (reduce nothing without a process
group, compute the new scales from the amax window, roll the history).

``test_update`` times it with no amax recorded since the last update (a slab updated in
a step none of its modules ran in): nothing moves, and the cost is the fixed one, Python
calls and one operator. ``test_update_recorded`` sets a fresh amax in every column before
each update (one ``fill_``), as a training step's quantizers leave them: every column
takes a new scale from its 1024-row window and rolls, so the time grows with
N x amax_history_len, at most linearly.

Each test runs on a registry of its own (the thread's registry is swapped out and put
back afterwards): equal recipes share one slab, so with a shared registry the modules
of an earlier test would stay columns of a later test's slab. Like ``bench_linear``, the
module runs on one intra-op thread, restored afterwards.

Before timing, the Python-level function calls of one update are counted with
``sys.setprofile`` and stored in the extra info: ``python_calls`` (Python functions)
and ``c_calls`` (builtins and methods implemented in C, tensor operations included).
Both should be the same for every N.

``python -m bench.bench_delayed [rounds]`` compares an ``fc.Linear`` forward+backward
under ``DelayedScaling`` with the same under ``Float8CurrentScaling`` (16x16 and
256x256 layers, 32 tokens), interleaved A/B (each round times one step of each, so
machine load hits both alike), and prints the medians, their ratio (target <= 1.2) and
the ATen operations one step dispatches.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastcast as fc
from fastcast.runtime.state import thread_state
from fastcast.schemes.delayed import FORWARD, DelayedState, DelayedThreadState

INNER = 10
FEATURES = 16
SIZES = [1, 10, 100, 400]

GROUP = "delayed-update"
GROUP_RECORDED = "delayed-update-recorded"

# The design target is O(1) Python calls in N (the update is one batched set of tensor
# operations per slab). The times: with nothing recorded the update reads row 0 only;
# after a step it reads and rolls the whole window, so its time may grow with the
# history's size (400x the elements), not faster.
TARGETS = [
    (
        GROUP,
        "test_update[400]",
        "test_update[1]",
        1.0,
        "delayed update, 400 modules / 1 module",
        "python_calls",
    ),
    (
        GROUP,
        "test_update[400]",
        "test_update[1]",
        20.0,
        "delayed update time, nothing recorded, 400 modules / 1 module",
    ),
    (
        GROUP_RECORDED,
        "test_update_recorded[400]",
        "test_update_recorded[1]",
        400.0,
        "delayed update time after a step, 400 modules / 1 module (history 1024 x 800 vs 1024 x 2)",
    ),
]


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def own_registry() -> Iterator[DelayedState]:
    """This thread's delayed-scaling state, emptied; the previous one is restored after."""
    schemes = thread_state().schemes
    saved = schemes.pop(DelayedThreadState, None)
    try:
        yield DelayedThreadState.of(thread_state()).own
    finally:
        schemes.pop(DelayedThreadState, None)
        if saved is not None:
            schemes[DelayedThreadState] = saved


def count_calls(fn: Callable[[], object]) -> tuple[int, int]:
    """``(Python function calls, C function calls)`` made by one call of ``fn``."""
    counts = {"call": 0, "c_call": 0}

    def profiler(frame, event, arg):
        if event in counts:
            counts[event] += 1

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    # The profiler sees the call of fn itself and, on the way out, of sys.setprofile.
    return counts["call"] - 1, counts["c_call"] - 1


def _time_update(benchmark, registry: DelayedState, n: int, recorded: bool) -> None:
    """Time the forward update of ``n`` modules' slab; with ``recorded`` every column
    holds a fresh amax before each update (a training step), else none does."""
    modules = [fc.Linear(FEATURES, FEATURES) for _ in range(n)]
    x = torch.randn(FEATURES, FEATURES)
    with torch.no_grad(), fc.autocast(recipe=fc.DelayedScaling()):
        for module in modules:
            module(x)

    forward_slabs = [s for (_, d, _), s in registry.slabs.items() if d == FORWARD]
    assert [s.scale.numel() for s in forward_slabs] == [2 * n]  # input and weight columns
    slab = forward_slabs[0]
    mark, end = registry.mark, registry.end
    amaxes = slab.history[0]  # (the slab is not rebuilt while the test runs)

    def update():
        if recorded:
            amaxes.fill_(1.0)  # what the modules' quantizers record in a step
        mark(slab, FORWARD)
        end(FORWARD)

    def loop():
        for _ in range(INNER):
            update()

    update()
    python_calls, c_calls = count_calls(update)
    benchmark.group = GROUP_RECORDED if recorded else GROUP
    benchmark.extra_info["inner"] = INNER
    benchmark.extra_info["modules"] = n
    benchmark.extra_info["python_calls"] = python_calls
    benchmark.extra_info["c_calls"] = c_calls
    benchmark(loop)


@pytest.mark.parametrize("n", SIZES)
def test_update(benchmark, own_registry, n):
    _time_update(benchmark, own_registry, n, recorded=False)


@pytest.mark.parametrize("n", SIZES)
def test_update_recorded(benchmark, own_registry, n):
    _time_update(benchmark, own_registry, n, recorded=True)


class _CountOps(TorchDispatchMode):
    """Counts the ATen operations dispatched (a fused operator counts as one)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def linear_ab(features: int, rounds: int = 300, tokens: int = 32) -> dict[str, tuple[float, int]]:
    """Median microseconds and ATen operations of one ``fc.Linear(features, features)``
    forward+backward step per recipe (``"current"``, ``"delayed"``), timed interleaved."""
    recipes = {"current": fc.Float8CurrentScaling(), "delayed": fc.DelayedScaling()}
    gen = torch.Generator().manual_seed(0)
    setups = {}
    for name in recipes:
        torch.manual_seed(0)
        layer = fc.Linear(features, features)
        x = torch.randn(tokens, features, generator=gen).requires_grad_()
        setups[name] = (layer, x)

    def step(name: str) -> None:
        layer, x = setups[name]
        with fc.autocast(recipe=recipes[name]):
            out = layer(x)
        out.sum().backward()
        x.grad = layer.weight.grad = layer.bias.grad = None

    ops = {}
    for name in recipes:
        for _ in range(10):  # plans, slabs and kernels made outside the timing
            step(name)
        with _CountOps() as counter:
            step(name)
        ops[name] = counter.count
    times: dict[str, list[float]] = {name: [] for name in recipes}
    for _ in range(rounds):
        for name in recipes:
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]) * 1e6, ops[name]) for name in recipes}


def main(rounds: int = 300) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the pytest benchmarks run
    try:
        for features in (16, 256):
            got = linear_ab(features, rounds)
            (cur, cur_ops), (dly, dly_ops) = got["current"], got["delayed"]
            print(
                f"fc.Linear({features}, {features}) fwd+bwd, 32 tokens: current {cur:.1f} us "
                f"({cur_ops} ATen ops), delayed {dly:.1f} us ({dly_ops} ATen ops), "
                f"delayed / current {dly / cur:.3f} (target <= 1.2)"
            )
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
