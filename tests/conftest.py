"""Shared fixtures for the fastcast test suite.

``gemm_mode``: switch ``FASTCAST_GEMM`` for one test. Either call the fixture's value,
``gemm_mode("hardware")``, or parametrize it indirectly::

    @pytest.mark.parametrize("gemm_mode", ["emulate"], indirect=True)
    def test_x(gemm_mode): ...

Every switch calls ``fastcast.runtime.hardware.refresh()`` so that the cached capability
answers are recomputed; on teardown the previous value is restored and the caches are
refreshed again, so no test sees another test's mode.

An autouse guard checks that every test leaves the main thread's autocast state as it
found it: a leaked frame would silently change what every later test runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from fastcast.runtime import hardware, state

_ENV = "FASTCAST_GEMM"


@pytest.fixture
def gemm_mode(request: pytest.FixtureRequest) -> Iterator[Callable[[str | None], None]]:
    """A setter for ``FASTCAST_GEMM`` (None unsets it); restored after the test."""
    saved = os.environ.get(_ENV)

    def set_mode(mode: str | None) -> None:
        if mode is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = mode
        hardware.refresh()

    param = getattr(request, "param", None)
    if param is not None:
        set_mode(param)
    try:
        yield set_mode
    finally:
        set_mode(saved)


@pytest.fixture(autouse=True)
def _no_leaked_autocast() -> Iterator[None]:
    before = state.get_stack()
    yield
    after = state.get_stack()
    if after is not before:
        state.set_stack(before)  # keep the following tests meaningful
        pytest.fail(f"the test left an autocast active: {after[0]!r}")


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny-tensor tests or benchmarks, restored after.

    The shapes are too small for torch's thread pool to help, and on a machine whose
    cores are shared its spinning workers can stall a tiny operation for milliseconds.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches and counters reset before and after a test (compile tests: each
    counts its own compilations and must not reuse another test's graphs)."""
    import torch._dynamo  # noqa: PLC0415 - only the compile tests pay for it

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Tests marked ``slow`` (kernel and wheel builds, nvcc, and the longest compile and
# multi-rank runs) run only with FASTCAST_SLOW_TESTS=1: ``make test-slow``, which
# .ci/run runs after ``make test``, so that ``make test`` stays under 10 minutes on a
# 2-core machine with empty caches.
RUN_SLOW = os.environ.get("FASTCAST_SLOW_TESTS") == "1"


# A run with the vector ISA capped (ATEN_CPU_CAPABILITY=default, avx2, ...) keeps its
# Inductor cache apart from the machine's native runs. Inductor's FX graph cache key
# (torch 2.13) holds its config but not ATEN_CPU_CAPABILITY, from which it picks the
# vector ISA when cpp.simdlen is unset: a graph cached by an AVX2 run is found again
# under ``default`` and its AVX2 C++ recompiled without the at::vec header ("'at::vec'
# has not been declared", a CppCompileError). Setting cpp.simdlen = 0 changes the key
# only where it is seen: torch keeps config overrides in ContextVars, which a new thread
# or a contextvars.Context() does not inherit, nor a spawned worker. The environment
# variable reaches all of them.
_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
if _CAPABILITY:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    _base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_base, f"aten-cpu-{_CAPABILITY}")


def pytest_collection_modifyitems(config, items):
    if RUN_SLOW:
        return
    skip = pytest.mark.skip(reason="slow: set FASTCAST_SLOW_TESTS=1 (make test-slow)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
