"""CPU overhead of ``fc.autocast`` against peers, of building recipes, of autocast keys.

Every timed function runs ``INNER`` iterations of the operation, in loops of the same
shape within a group (names bound to locals first), so that the per-iteration times in
the report differ only by the operation itself.

The autocast group runs in a fresh ``contextvars.Context`` (every entry, peers included):
``fc.autocast`` keeps its state in a context variable, and setting one costs more the more
variables the context holds. A training script's context holds none (measured after a
Hugging Face Llama training step: ``len(contextvars.copy_context()) == 0``); pytest's holds
one (``decimal``'s), which adds about 0.4x of an empty context manager to every context
variable set and reset. ``test_fc_autocast_in_pytest_context`` measures that case, and
``test_contextvar_cm`` the floor of any per-context state: a context manager that only
sets and resets a variable.
"""

from __future__ import annotations

import contextlib
import contextvars

import pytest
import torch

import fastcast as fc
from fastcast.runtime.state import autocast_key

INNER = 1000

AUTOCAST = "autocast enter+exit"
RECIPE = "recipe construction"
KEY = "autocast key"

TARGETS = [
    (AUTOCAST, "test_fc_autocast", "test_empty_slots_cm", 2.0, "fc.autocast / empty __slots__ CM"),
    (
        AUTOCAST,
        "test_fc_autocast",
        "test_slots_cm_storing_args",
        2.0,
        "fc.autocast / __slots__ CM storing 4 args",
    ),
    (
        AUTOCAST,
        "test_fc_autocast",
        "test_torch_autocast_cpu",
        0.25,
        "fc.autocast / torch.autocast('cpu')",
    ),
    (
        AUTOCAST,
        "test_fc_autocast_nested_same_recipe",
        "test_fc_autocast",
        2.0,
        "two nested levels (same recipe) / one level",
    ),
    (
        AUTOCAST,
        "test_fc_autocast_nested_two_recipes",
        "test_fc_autocast",
        2.0,
        "two nested levels (two recipes) / one level",
    ),
    (
        AUTOCAST,
        "test_fc_autocast_default_recipe",
        "test_fc_autocast",
        1.5,
        "recipe=None / one level",
    ),
    (AUTOCAST, "test_fc_autocast_disabled", "test_fc_autocast", 1.5, "enabled=False / one level"),
]


class EmptyCM:
    """The cheapest context manager a class can be."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return None


class SlotsCMWithArgs:
    """An empty context manager that takes and stores autocast's four arguments."""

    __slots__ = ("enabled", "recipe", "calibrating", "amax_reduction_group")

    def __init__(self, enabled=True, recipe=None, calibrating=False, amax_reduction_group=None):
        self.enabled = enabled
        self.recipe = recipe
        self.calibrating = calibrating
        self.amax_reduction_group = amax_reduction_group

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return None


@contextlib.contextmanager
def generator_cm(enabled=True, recipe=None, calibrating=False, amax_reduction_group=None):
    yield


def _run(benchmark, group, loop, context=True):
    """Time ``loop``; in a fresh context unless ``context`` is False (see above)."""
    benchmark.group = group
    benchmark.extra_info["inner"] = INNER
    if context:
        benchmark(contextvars.Context().run, loop)
    else:
        benchmark(loop)
    assert not fc.is_autocast_enabled() and fc.get_autocast_recipe() is None


# --------------------------------------------------------------------------- autocast


def test_fc_autocast(benchmark):
    cm, recipe = fc.autocast, fc.DelayedScaling()

    def loop():
        for _ in range(INNER):
            with cm(recipe=recipe):
                pass

    _run(benchmark, AUTOCAST, loop)


def test_fc_autocast_in_pytest_context(benchmark):
    """As test_fc_autocast, in pytest's own context (one context variable set)."""
    cm, recipe = fc.autocast, fc.DelayedScaling()

    def loop():
        for _ in range(INNER):
            with cm(recipe=recipe):
                pass

    _run(benchmark, AUTOCAST, loop, context=False)


_var: contextvars.ContextVar = contextvars.ContextVar("bench_autocast", default=None)


class ContextVarCM:
    """The floor of per-context state: set a context variable, reset it on exit."""

    __slots__ = ("token",)

    def __enter__(self):
        self.token = _var.set(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        _var.reset(self.token)


def test_contextvar_cm(benchmark):
    cm = ContextVarCM

    def loop():
        for _ in range(INNER):
            with cm():
                pass

    _run(benchmark, AUTOCAST, loop)


def test_fc_autocast_traced(benchmark):
    """fc.autocast with fastcast's ranges on (fc.profiling.enable(), no profiler
    attached): enter and exit each run in an NVTX range and a record_function scope."""
    cm, recipe = fc.autocast, fc.DelayedScaling()

    def loop():
        for _ in range(INNER):
            with cm(recipe=recipe):
                pass

    fc.profiling.enable()
    try:
        _run(benchmark, AUTOCAST, loop)
    finally:
        fc.profiling.disable()


def test_empty_slots_cm(benchmark):
    cm = EmptyCM

    def loop():
        for _ in range(INNER):
            with cm():
                pass

    _run(benchmark, AUTOCAST, loop)


def test_slots_cm_storing_args(benchmark):
    cm, recipe = SlotsCMWithArgs, fc.DelayedScaling()

    def loop():
        for _ in range(INNER):
            with cm(recipe=recipe):
                pass

    _run(benchmark, AUTOCAST, loop)


def test_contextmanager_generator(benchmark):
    cm, recipe = generator_cm, fc.DelayedScaling()

    def loop():
        for _ in range(INNER):
            with cm(recipe=recipe):
                pass

    _run(benchmark, AUTOCAST, loop)


def test_torch_autocast_cpu(benchmark):
    cm = torch.autocast

    def loop():
        for _ in range(INNER):
            with cm("cpu"):
                pass

    _run(benchmark, AUTOCAST, loop)


def test_te_fp8_autocast(benchmark):
    """TransformerEngine's ``fp8_autocast`` (a ``@contextmanager`` over global state),
    disabled so that it runs without FP8 hardware; skipped where TE does not import."""
    try:
        from transformer_engine.pytorch import fp8_autocast  # noqa: PLC0415 - optional peer
    except Exception as exc:  # noqa: BLE001 - absent, or no CUDA: skip either way
        pytest.skip(f"transformer_engine is not importable: {exc}")
    cm = fp8_autocast

    def loop():
        for _ in range(INNER):
            with cm(enabled=False):
                pass

    _run(benchmark, AUTOCAST, loop)


def test_fc_autocast_default_recipe(benchmark):
    cm = fc.autocast

    def loop():
        for _ in range(INNER):
            with cm():
                pass

    _run(benchmark, AUTOCAST, loop)


def test_fc_autocast_disabled(benchmark):
    cm, recipe = fc.autocast, fc.DelayedScaling()

    def loop():
        for _ in range(INNER):
            with cm(enabled=False, recipe=recipe):
                pass

    _run(benchmark, AUTOCAST, loop)


def test_fc_autocast_nested_same_recipe(benchmark):
    cm, recipe = fc.autocast, fc.DelayedScaling()

    def loop():
        for _ in range(INNER):
            with cm(recipe=recipe):
                with cm(recipe=recipe):
                    pass

    _run(benchmark, AUTOCAST, loop)


def test_fc_autocast_nested_two_recipes(benchmark):
    cm, outer, inner = fc.autocast, fc.DelayedScaling(), fc.Float8CurrentScaling()

    def loop():
        for _ in range(INNER):
            with cm(recipe=outer):
                with cm(recipe=inner):
                    pass

    _run(benchmark, AUTOCAST, loop)


# --------------------------------------------------------------------------- recipes


def test_build_delayed_scaling(benchmark):
    make = fc.DelayedScaling

    def loop():
        for _ in range(INNER):
            make()

    _run(benchmark, RECIPE, loop)


def test_build_float8_current_scaling(benchmark):
    make = fc.Float8CurrentScaling

    def loop():
        for _ in range(INNER):
            make()

    _run(benchmark, RECIPE, loop)


def test_build_float8_block_scaling(benchmark):
    make = fc.Float8BlockScaling

    def loop():
        for _ in range(INNER):
            make()

    _run(benchmark, RECIPE, loop)


# --------------------------------------------------------------------------- keys


class _Group:
    """Stands in for a process group."""


def test_autocast_key_no_group(benchmark):
    key, recipe, group = autocast_key, fc.DelayedScaling(), None

    def loop():
        for _ in range(INNER):
            key(recipe, group)

    _run(benchmark, KEY, loop)


def test_autocast_key_with_group(benchmark):
    key, recipe, group = autocast_key, fc.DelayedScaling(), _Group()

    def loop():
        for _ in range(INNER):
            key(recipe, group)

    _run(benchmark, KEY, loop)
