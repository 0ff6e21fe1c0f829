"""Tracing ranges: NVTX + torch.profiler scopes after ``fc.profiling.enable()`` (or
FASTCAST_NVTX=1 at import), named and nested as users read them in a trace, through the
state manager's observer points; no function is ever replaced, on or off."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import fastcast as fc
from fastcast import gemm, profiling
from fastcast.nn import function, linear
from fastcast.quantizers import tensorwise
from fastcast.runtime import observers
from fastcast.schemes import delayed

autocast_module = importlib.import_module("fastcast.autocast")  # not the class

# Where the hot path looks each function with a range up at call time.
HOT_PATH = {
    "fastcast.autocast.enter": lambda: vars(autocast_module.autocast)["__enter__"],
    "fastcast.autocast.exit": lambda: vars(autocast_module.autocast)["__exit__"],
    "fastcast.Linear.forward": lambda: vars(linear.Linear)["forward"],
    "fastcast.Linear.backward": lambda: vars(function.LinearFunction)["backward"],
    "fastcast.scaled_mm": lambda: gemm._product,  # behind fc.scaled_mm and fc.Linear's GEMMs
    "fastcast.amax_update": lambda: vars(delayed.DelayedState)["end"],
    "fastcast.quantize.tensorwise": lambda: vars(tensorwise.CurrentScalingQuantizer)["quantize"],
}


@pytest.fixture
def tracing() -> Iterator[None]:
    profiling.enable()
    try:
        yield
    finally:
        profiling.disable()


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    return fc.convert(model, recipe=fc.DelayedScaling())


def _profiled_step(model: nn.Module, recipe: fc.Recipe) -> list:
    x = torch.randn(8, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with fc.autocast(recipe=recipe):
            y = model(x)
        y.sum().backward()
    return list(prof.events())


def _fastcast(events: list) -> list:
    return [e for e in events if e.name.startswith("fastcast.")]


def _inside(event, names: tuple[str, ...]) -> list[str]:
    """Names of the fastcast ranges nested anywhere under ``event``."""
    found, stack = [], list(event.cpu_children)
    while stack:
        child = stack.pop()
        if child.name.startswith(names):
            found.append(child.name)
        stack.extend(child.cpu_children)
    return found


def test_off_attaches_nothing_and_every_range_is_listed():
    assert not profiling.is_enabled()  # the test suite runs without FASTCAST_NVTX
    assert not any(type(o) is profiling.Ranges for o in observers.attached)
    # Every range a trace can hold is listed: the list users read in the docs.
    assert set(HOT_PATH) <= set(profiling.marked_names())


def test_enable_attaches_an_observer_and_replaces_nothing():
    originals = {name: where() for name, where in HOT_PATH.items()}
    made = fc.autocast(recipe=fc.Float8CurrentScaling())
    native = (type(made).__dict__["__enter__"], type(made).__dict__["__exit__"])
    profiling.enable()
    try:
        profiling.enable()  # twice is once
        assert [type(o) for o in observers.attached].count(profiling.Ranges) == 1
        for name, where in HOT_PATH.items():
            assert where() is originals[name], name
        assert (type(made).__dict__["__enter__"], type(made).__dict__["__exit__"]) == native
        # The public GEMM, called directly, runs inside the range too.
        q = fc.quantize(torch.randn(16, 16), fc.Float8CurrentScaling())
        with torch.profiler.profile() as prof:
            fc.scaled_mm(q, q)
        assert "fastcast.scaled_mm" in {e.name for e in prof.events()}
    finally:
        profiling.disable()
    for name, where in HOT_PATH.items():
        assert where() is originals[name], name
    assert not profiling.is_enabled()
    assert observers.attached == []


def test_ranges_appear_in_torch_profiler_with_module_names(tracing):
    events = _profiled_step(_model(), fc.DelayedScaling())
    names = [e.name for e in _fastcast(events)]
    # One forward and one backward range per converted module, named by fc.convert's name.
    for module in ("0", "2"):
        assert names.count(f"fastcast.Linear.forward[{module}]") == 1, names
        assert names.count(f"fastcast.Linear.backward[{module}]") == 1, names
    assert names.count("fastcast.autocast.enter") == 1
    assert names.count("fastcast.autocast.exit") == 1
    # Delayed scaling: the forward update at the autocast exit, the backward one at the end.
    assert names.count("fastcast.amax_update") == 2
    # Three GEMMs per layer (forward, dgrad, wgrad); the first layer's input needs dgrad.
    assert names.count("fastcast.scaled_mm") == 6

    # No range nests in one of its own kind: the report counts every call once.
    for e in _fastcast(events):
        kind = e.name.split("[")[0]
        assert not any(n.split("[")[0] == kind for n in _inside(e, ("fastcast.",))), e.name
    by_name = {e.name: e for e in _fastcast(events)}
    for pass_ in ("forward", "backward"):
        inner = _inside(by_name[f"fastcast.Linear.{pass_}[2]"], ("fastcast.",))
        assert "fastcast.scaled_mm" in inner and any(
            n.startswith("fastcast.quantize.") for n in inner
        ), inner
        assert not any(n.startswith("fastcast.Linear") for n in inner)  # no cross-nesting
    # The autocast scopes are its own enter and exit calls, not the with-body.
    assert _inside(by_name["fastcast.autocast.enter"], ("fastcast.Linear",)) == []
    assert by_name["fastcast.autocast.exit"].time_range.start > max(
        by_name[f"fastcast.Linear.forward[{m}]"].time_range.end for m in ("0", "2")
    )


def test_unconverted_linear_has_the_plain_range_name(tracing):
    torch.manual_seed(0)
    layer = fc.Linear(32, 32)
    x = torch.randn(4, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with fc.autocast(recipe=fc.Float8CurrentScaling()):
            y = layer(x)
        y.sum().backward()
    names = [e.name for e in _fastcast(list(prof.events()))]
    assert "fastcast.Linear.forward" in names and "fastcast.Linear.backward" in names


def test_padded_rows_still_name_the_backward(tracing):
    # MXFP8 pads 5 tokens to 32 rows: the output is a slice of the Function's output.
    model = fc.convert(nn.Sequential(nn.Linear(32, 32)), recipe=fc.MXFP8BlockScaling())
    x = torch.randn(5, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with fc.autocast(recipe=fc.MXFP8BlockScaling()):
            y = model(x)
        y.sum().backward()
    names = [e.name for e in _fastcast(list(prof.events()))]
    assert "fastcast.Linear.backward[0]" in names, names


def test_an_error_inside_a_range_leaves_the_trace_balanced(tracing):
    model = _model()
    with pytest.raises(ValueError, match=r"fc.Linear '0'"):
        with fc.autocast(recipe=fc.DelayedScaling()):
            model(torch.randn(4, 31))  # wrong feature count: the layer raises, named
    # The next step's ranges still nest as before: nothing was left open.
    events = _profiled_step(model, fc.DelayedScaling())
    forwards = [e for e in _fastcast(events) if e.name.startswith("fastcast.Linear.forward")]
    assert len(forwards) == 2
    for e in forwards:
        assert "fastcast.scaled_mm" in _inside(e, ("fastcast.",))


def test_results_are_the_same_traced_or_not():
    def step() -> tuple[torch.Tensor, torch.Tensor]:
        model = _model()
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        for _ in range(2):  # a second step uses the delayed scales the first updated
            with fc.autocast(recipe=fc.DelayedScaling()):
                y = model(x)
            y.sum().backward()
        return y.detach(), model[0].weight.grad

    plain = step()
    profiling.enable()
    try:
        traced = step()
    finally:
        profiling.disable()
    for a, b in zip(plain, traced):
        assert torch.equal(a, b)


def test_disabled_again_records_no_range():
    profiling.enable()
    profiling.disable()
    events = _profiled_step(_model(), fc.DelayedScaling())
    assert _fastcast(events) == []


def test_environment_variable_enables_at_import():
    script = textwrap.dedent(
        """
        import torch
        import fastcast as fc
        from fastcast import gemm, profiling
        assert profiling.is_enabled()
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


@pytest.mark.compile
def test_traced_functions_compile_fullgraph(tracing, fresh_dynamo):
    # Dynamo traces through the wrappers (no range inside a graph) without a graph break.
    model = fc.convert(nn.Sequential(nn.Linear(32, 32)), recipe=fc.Float8CurrentScaling())
    recipe = fc.Float8CurrentScaling()

    def forward(x):
        with fc.autocast(recipe=recipe):
            return model(x)

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(forward, fullgraph=True)
    profiling.disable()
    expected = forward(x)  # eager, untraced
    profiling.enable()
    assert torch.equal(compiled(x), expected)
