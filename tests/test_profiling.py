"""NVTX ranges: absent (the very same functions) unless FASTCAST_NVTX=1 at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import fastcast as fc
from fastcast import gemm, profiling
from fastcast.nn import linear


def test_disabled_ranges_leave_functions_unwrapped():
    assert not profiling.NVTX_ENABLED  # the test suite runs without FASTCAST_NVTX

    def f(x):
        return x + 1

    assert profiling.annotate("x")(f) is f
    # The hot-path functions are the undecorated originals: nothing runs per call.
    assert not hasattr(gemm.scaled_mm, "__wrapped__")
    assert not hasattr(linear.Linear.forward, "__wrapped__")


def test_enabled_ranges_wrap_and_training_still_runs():
    script = textwrap.dedent(
        """
        import torch
        import fastcast as fc
        from fastcast import gemm, profiling
        assert profiling.NVTX_ENABLED
        assert hasattr(gemm.scaled_mm, "__wrapped__")
        lin = fc.Linear(32, 32)
        x = torch.randn(8, 32, requires_grad=True)
        for recipe in (fc.Float8CurrentScaling(), fc.DelayedScaling()):
            with fc.autocast(recipe=recipe):
                y = lin(x)
            y.sum().backward()
        assert x.grad is not None and lin.weight.grad is not None
        print("ok")
        """
    )
    env = dict(os.environ, FASTCAST_NVTX="1")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
    assert fc.is_autocast_enabled() is False
