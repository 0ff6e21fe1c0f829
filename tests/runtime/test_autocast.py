"""``fc.autocast``: nesting, restoration, re-entry, decorators, threads, support checks.

Every test runs twice: with the C construction, ``__enter__`` and ``__exit__``
(``fastcast/runtime/_native.c``, skipped where it is not built) and with the Python
methods alone, the reference that runs where it is not built."""

from __future__ import annotations

import importlib
import os
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastcast as fc
from fastcast.runtime import hardware, state
from fastcast.runtime.state import OUTSIDE

autocast_module = importlib.import_module("fastcast.autocast")  # the module, not the class

ON_CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="asserts the CPU capability table"
)


@pytest.fixture(autouse=True, params=["native", "python"])
def construction(request):
    """Which implementation the usual ``fc.autocast(...)`` call gets in this test."""
    native = autocast_module._native
    if native is None:
        if request.param == "native":
            pytest.skip("fastcast.runtime._native is not built here")
        yield request.param
        return
    native.set_fast_construction(request.param == "native")
    try:
        yield request.param
    finally:
        native.set_fast_construction(True)


def quantizer_factory(role):
    return role


RECIPES = [
    fc.DelayedScaling(),
    fc.DelayedScaling(margin=1),
    fc.Float8CurrentScaling(),
    fc.Float8BlockScaling(),
    fc.MXFP8BlockScaling(),
    fc.NVFP4BlockScaling(),
    fc.Float8RowwiseScaling(),
    fc.CustomRecipe(quantizer_factory),
]


def observed():
    """What a module in this thread would see."""
    return fc.is_autocast_enabled(), fc.get_autocast_recipe(), state.current_frame().calibrating


def assert_outside():
    assert state.current_frame() is OUTSIDE
    assert fc.is_autocast_enabled() is False
    assert fc.get_autocast_recipe() is None


# --------------------------------------------------------------------------- basics


def test_outside_any_autocast():
    assert_outside()


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("recipe", RECIPES[:3], ids=lambda r: type(r).__name__)
def test_inside_and_after(enabled, recipe):
    with fc.autocast(enabled=enabled, recipe=recipe) as ac:
        assert isinstance(ac, fc.autocast)
        assert state.current_frame() is ac
        assert fc.is_autocast_enabled() is enabled
        assert fc.get_autocast_recipe() is recipe
    assert_outside()


@pytest.mark.parametrize("outer", [True, False])
@pytest.mark.parametrize("inner", [True, False])
def test_enabled_combinations(outer, inner):
    r_out, r_in = fc.DelayedScaling(), fc.Float8CurrentScaling()
    with fc.autocast(enabled=outer, recipe=r_out):
        assert observed() == (outer, r_out, False)
        with fc.autocast(enabled=inner, recipe=r_in, calibrating=True):
            assert observed() == (inner, r_in, True)
        assert observed() == (outer, r_out, False)
    assert_outside()


def test_default_recipe_is_built_once():
    with fc.autocast():
        first = fc.get_autocast_recipe()
        assert fc.is_autocast_enabled()
    with fc.autocast():
        second = fc.get_autocast_recipe()
    with fc.autocast(enabled=False):
        third = fc.get_autocast_recipe()
    assert isinstance(first, fc.Recipe)
    assert first is second is third
    assert fc.autocast().recipe is first


@ON_CPU_ONLY
def test_default_recipe_on_cpu_is_delayed_scaling():
    with fc.autocast():
        assert fc.get_autocast_recipe() == fc.DelayedScaling()


def test_exception_restores_state_and_propagates():
    r1, r2 = fc.DelayedScaling(), fc.Float8CurrentScaling()
    with pytest.raises(KeyError, match="boom"):
        with fc.autocast(recipe=r1):
            with fc.autocast(recipe=r2):
                raise KeyError("boom")
    assert_outside()
    with fc.autocast(recipe=r1) as outer:
        try:
            with fc.autocast(recipe=r2, enabled=False):
                raise ValueError
        except ValueError:
            pass
        assert state.current_frame() is outer
        assert observed() == (True, r1, False)
    assert_outside()


def test_base_exception_restores_state():
    with pytest.raises(KeyboardInterrupt):
        with fc.autocast(recipe=fc.DelayedScaling()):
            raise KeyboardInterrupt
    assert_outside()


def test_exit_does_not_swallow_exceptions():
    ac = fc.autocast(recipe=fc.DelayedScaling())
    ac.__enter__()
    assert not ac.__exit__(RuntimeError, RuntimeError("x"), None)
    assert_outside()


def test_nesting_depth_10_with_exact_restoration():
    levels = [(RECIPES[i % len(RECIPES)], i % 3 != 2, i % 4 == 1) for i in range(10)]

    def enter(depth):
        if depth == len(levels):
            return
        below = (observed(), state.current_frame())
        recipe, enabled, calibrating = levels[depth]
        with fc.autocast(enabled=enabled, recipe=recipe, calibrating=calibrating) as ac:
            assert observed() == (enabled, recipe, calibrating)
            assert state.current_frame() is ac
            enter(depth + 1)
            assert observed() == (enabled, recipe, calibrating)
            assert state.current_frame() is ac
        assert (observed(), state.current_frame()) == below

    enter(0)
    assert_outside()


# --------------------------------------------------------------------------- re-entry


def test_reentering_an_active_instance_raises_and_keeps_state():
    r1, r2 = fc.DelayedScaling(), fc.Float8CurrentScaling()
    a = fc.autocast(recipe=r1)
    with a:
        with pytest.raises(RuntimeError, match="already active"):
            with a:
                pytest.fail("entered an active instance")
        assert state.current_frame() is a
        assert observed() == (True, r1, False)
        with fc.autocast(enabled=False, recipe=r2) as b:
            with pytest.raises(RuntimeError, match="already active"):
                a.__enter__()
            assert state.current_frame() is b
        assert state.current_frame() is a
    assert_outside()


def test_finished_instance_can_be_reentered():
    r1, r2 = fc.DelayedScaling(), fc.Float8CurrentScaling()
    a = fc.autocast(recipe=r1)
    for _ in range(3):
        with a:
            assert observed() == (True, r1, False)
        assert_outside()
    with fc.autocast(recipe=r2) as b:
        with a:
            assert state.current_frame() is a
        assert state.current_frame() is b
        with a:  # again, at another depth
            assert observed() == (True, r1, False)
        assert observed() == (True, r2, False)
    assert_outside()
    # An instance whose block raised can be entered again too.
    with pytest.raises(ZeroDivisionError):
        with a:
            1 / 0  # noqa: B018
    with a:
        assert state.current_frame() is a
    assert_outside()


def test_one_instance_active_in_two_threads_at_once():
    """Entering stores nothing in the instance: another thread may use it meanwhile,
    and each thread's stack stays its own."""
    r = fc.DelayedScaling()
    a = fc.autocast(recipe=r)
    seen = []

    def other():
        seen.append(state.current_frame())
        with a:
            seen.append(state.current_frame())
            with pytest.raises(RuntimeError, match="already active"):
                a.__enter__()
        seen.append(state.current_frame())

    with a:
        t = threading.Thread(target=other)
        t.start()
        t.join(timeout=10)
        assert state.current_frame() is a
    assert seen == [OUTSIDE, a, OUTSIDE]
    assert state.current_frame() is OUTSIDE


# --------------------------------------------------------------------------- decorator


def test_decorator():
    r = fc.DelayedScaling(margin=2)

    @fc.autocast(recipe=r, calibrating=True)
    def f(x, *, y=0):
        """Docstring kept."""
        return observed(), x + y

    assert f(1, y=2) == ((True, r, True), 3)
    assert f.__name__ == "f" and f.__doc__ == "Docstring kept."
    assert_outside()
    with fc.autocast(enabled=False, recipe=fc.Float8CurrentScaling()) as outer:
        assert f(0) == ((True, r, True), 0)
        assert state.current_frame() is outer
    assert_outside()


def test_decorated_function_raising():
    @fc.autocast(recipe=fc.DelayedScaling())
    def f():
        raise LookupError("inside")

    with pytest.raises(LookupError, match="inside"):
        f()
    assert_outside()


def test_recursive_decorated_function_does_not_trip_reentry_guard():
    r = fc.Float8CurrentScaling()
    frames = []

    @fc.autocast(recipe=r)
    def walk(n):
        frames.append(state.current_frame())
        assert observed() == (True, r, False)
        return 0 if n == 0 else 1 + walk(n - 1)

    assert walk(5) == 5
    assert len(frames) == 6 and len({id(f) for f in frames}) == 6
    assert_outside()


def test_decorator_instance_active_as_context_manager_too():
    r = fc.DelayedScaling()
    dec = fc.autocast(recipe=r)

    @dec
    def f():
        return state.current_frame()

    with dec:
        inner = f()
        assert inner is not dec and state.current_frame() is dec
    assert_outside()


# --------------------------------------------------------------------------- threads


def _run_threads(targets, timeout=10):
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_two_threads_with_overlapping_autocasts_see_their_own():
    recipes = [fc.DelayedScaling(), fc.Float8CurrentScaling()]
    barrier = threading.Barrier(2, timeout=10)
    seen = {}

    def worker(i):
        def run():
            assert_outside()
            with fc.autocast(recipe=recipes[i], enabled=bool(i)):
                barrier.wait()  # both threads are inside their autocast now
                first = observed()
                barrier.wait()  # both have looked before either exits
                with fc.autocast(recipe=recipes[1 - i]):
                    barrier.wait()
                    nested = observed()
                    barrier.wait()
                barrier.wait()
                after_nested = observed()
            barrier.wait()  # one thread's exit must not touch the other's state
            seen[i] = (first, nested, after_nested, observed())

        return run

    r = fc.DelayedScaling(margin=3)
    with fc.autocast(recipe=r):
        _run_threads([worker(0), worker(1)])
        assert observed() == (True, r, False)
    for i in (0, 1):
        first, nested, after_nested, end = seen[i]
        assert first == after_nested == (bool(i), recipes[i], False)
        assert nested == (True, recipes[1 - i], False)
        assert end == (False, None, False)


def test_new_thread_sees_no_autocast():
    seen = []
    with fc.autocast(recipe=fc.DelayedScaling()):
        _run_threads([lambda: seen.append((state.current_frame(), observed()))])
    assert seen == [(OUTSIDE, (False, None, False))]


def test_many_threads_hammering():
    n_threads, n_iter = 4, 300

    def worker(i):
        def run():
            mine = RECIPES[i]
            for _ in range(n_iter):
                with fc.autocast(recipe=mine):
                    assert fc.get_autocast_recipe() is mine
                    with fc.autocast(enabled=False, recipe=RECIPES[-1]):
                        assert observed() == (False, RECIPES[-1], False)
                    assert fc.get_autocast_recipe() is mine
                assert_outside()

        return run

    # Switch threads as often as possible, so that the loops really interleave.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _run_threads([worker(i) for i in range(n_threads)])
    finally:
        sys.setswitchinterval(interval)


# --------------------------------------------------------------------------- recipe checks


@pytest.mark.parametrize(
    "bad",
    ["DelayedScaling", fc.DelayedScaling, 42, object(), {"margin": 0}],
    ids=["str", "class", "int", "object", "dict"],
)
@pytest.mark.parametrize("enabled", [True, False])
def test_non_recipe_is_a_type_error(bad, enabled):
    with fc.autocast(recipe=fc.DelayedScaling()) as outer:
        with pytest.raises(TypeError, match="recipe must be a fastcast recipe"):
            with fc.autocast(enabled=enabled, recipe=bad):
                pytest.fail("entered with a non-recipe")
        assert state.current_frame() is outer
    assert_outside()


def test_fp8_available_functions_return_bool_and_reason():
    for fn in (
        fc.fp8_available,
        fc.fp8_block_scaling_available,
        fc.fp8_rowwise_available,
        fc.mxfp8_available,
        fc.nvfp4_available,
    ):
        result = fn()
        assert isinstance(result, tuple) and len(result) == 2
        ok, reason = result
        assert isinstance(ok, bool)
        assert isinstance(reason, str) and reason


@ON_CPU_ONLY
def test_unsupported_recipe_raises_only_when_enabled(gemm_mode):
    gemm_mode("hardware")
    assert fc.fp8_available()[0] is True
    assert fc.fp8_rowwise_available()[0] is True  # the CPU kernel takes per-row scales
    for available in (fc.mxfp8_available, fc.nvfp4_available, fc.fp8_block_scaling_available):
        ok, reason = available()
        assert ok is False and "FASTCAST_GEMM" in reason
    for recipe in (fc.MXFP8BlockScaling(), fc.NVFP4BlockScaling(), fc.Float8BlockScaling()):
        with pytest.raises(RuntimeError, match="FASTCAST_GEMM") as info:
            with fc.autocast(recipe=recipe):
                pytest.fail("entered an unsupported recipe")
        assert type(recipe).__name__ in str(info.value)
        assert_outside()
        # A disabled level runs nothing, so it is accepted ...
        with fc.autocast(enabled=False, recipe=recipe) as off:
            assert observed() == (False, recipe, False)
            # ... but that does not make the recipe acceptable when enabled.
            with pytest.raises(RuntimeError, match="FASTCAST_GEMM"):
                with fc.autocast(recipe=recipe):
                    pytest.fail("entered an unsupported recipe")
            assert state.current_frame() is off
        with pytest.raises(RuntimeError, match="FASTCAST_GEMM"):
            with fc.autocast(recipe=recipe):
                pytest.fail("entered an unsupported recipe")
        assert_outside()
    # Tensorwise recipes have a CPU _scaled_mm kernel; custom recipes decide per GEMM.
    for recipe in (fc.DelayedScaling(), fc.Float8CurrentScaling(), RECIPES[-1]):
        with fc.autocast(recipe=recipe):
            assert observed() == (True, recipe, False)


@ON_CPU_ONLY
def test_mode_switch_forgets_earlier_acceptance(gemm_mode):
    recipe = fc.MXFP8BlockScaling()
    gemm_mode("auto")  # the CPU emulates what it has no kernel for
    for _ in range(2):
        with fc.autocast(recipe=recipe):
            assert fc.is_autocast_enabled()
    gemm_mode("hardware")
    with pytest.raises(RuntimeError, match="FASTCAST_GEMM"):
        with fc.autocast(recipe=recipe):
            pytest.fail("an acceptance from the earlier mode was reused")
    gemm_mode("emulate")
    with fc.autocast(recipe=recipe):
        assert fc.is_autocast_enabled()


@pytest.mark.parametrize("gemm_mode", ["emulate"], indirect=True)
def test_emulate_mode_runs_every_recipe(gemm_mode):
    for available in (
        fc.fp8_available,
        fc.fp8_block_scaling_available,
        fc.fp8_rowwise_available,
        fc.mxfp8_available,
        fc.nvfp4_available,
    ):
        ok, reason = available()
        assert ok is True and "emulat" in reason
    for recipe in RECIPES:
        with fc.autocast(recipe=recipe):
            assert observed() == (True, recipe, False)


def test_invalid_gemm_mode_is_a_clear_error(gemm_mode):
    gemm_mode("fastest")
    with pytest.raises(ValueError, match="FASTCAST_GEMM"):
        fc.fp8_available()
    with pytest.raises(ValueError, match="FASTCAST_GEMM"):
        with fc.autocast(recipe=fc.Float8CurrentScaling()):
            pytest.fail("entered with an invalid FASTCAST_GEMM")
    assert_outside()


def test_gemm_mode_fixture_sets_env_and_refreshes(gemm_mode):
    gemm_mode("emulate")
    assert os.environ["FASTCAST_GEMM"] == "emulate"
    assert hardware.gemm_mode() == "emulate"  # no stale cached answer
    gemm_mode(None)
    assert "FASTCAST_GEMM" not in os.environ
    assert hardware.gemm_mode() == "auto"


@ON_CPU_ONLY
def test_mode_switch_applies_to_other_threads(gemm_mode):
    recipe = fc.MXFP8BlockScaling()
    gemm_mode("auto")
    switched, outcome = threading.Event(), []

    def worker():
        with fc.autocast(recipe=recipe):  # accepted under auto (emulated)
            pass
        switched.wait(timeout=10)
        try:
            with fc.autocast(recipe=recipe):
                outcome.append("entered")
        except RuntimeError:
            outcome.append("refused")

    t = threading.Thread(target=worker)
    t.start()
    try:
        gemm_mode("hardware")
    finally:
        switched.set()
        t.join(timeout=10)
    assert outcome == ["refused"]


# --------------------------------------------------------------------------- properties

POOL = [None, *RECIPES[:4], RECIPES[-1]]


class Unwind(Exception):
    """Raised inside a level; caught ``levels`` levels further out."""

    def __init__(self, levels):
        super().__init__(levels)
        self.levels = levels


def level_specs(children):
    return st.tuples(
        st.integers(0, len(POOL) - 1),  # recipe
        st.booleans(),  # enabled
        st.booleans(),  # calibrating
        st.sampled_from([0, 0, 0, 1, 2, 3]),  # raise Unwind(levels) at the end (0: no)
        st.one_of(st.none(), st.integers(0, 9)),  # try to re-enter an active instance
        children,
    )


trees = st.recursive(
    level_specs(st.just([])),
    lambda inner: level_specs(st.lists(inner, max_size=3)),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(trees, max_size=4))
def test_nested_autocast_matches_model_stack(program):
    default = fc.autocast().recipe
    model, active = [], []

    def expected():
        return model[-1] if model else (False, None, False)

    def run_level(spec):
        idx, enabled, calibrating, raise_levels, reenter, children = spec
        recipe = POOL[idx]
        ac = fc.autocast(enabled=enabled, recipe=recipe, calibrating=calibrating)
        model.append((enabled, default if recipe is None else recipe, calibrating))
        try:
            with ac:
                active.append(ac)
                try:
                    assert observed() == expected()
                    assert state.current_frame() is ac
                    if reenter is not None:
                        victim = active[reenter % len(active)]
                        with pytest.raises(RuntimeError, match="already active"):
                            with victim:
                                pytest.fail("entered an active instance")
                        assert observed() == expected()
                        assert state.current_frame() is ac
                    run_block(children)
                    assert observed() == expected()
                    if raise_levels:
                        raise Unwind(raise_levels)
                finally:
                    active.pop()
        finally:
            model.pop()
            assert observed() == expected()

    def run_block(levels):
        for spec in levels:
            try:
                run_level(spec)
            except Unwind as e:
                e.levels -= 1
                if e.levels > 0:
                    raise
                assert observed() == expected()

    try:
        run_block(program)
    except Unwind:
        pass
    assert not model and not active
    assert_outside()


def test_positional_recipe_names_the_keyword():
    with pytest.raises(TypeError, match=r"keyword-only: write fc.autocast\(True, recipe=\.\.\.\)"):
        fc.autocast(True, fc.Float8CurrentScaling())
    assert_outside()


@pytest.fixture
def unused_warning_due(monkeypatch):
    monkeypatch.setattr(state.autocast_state, "warning_due", True)


def test_enabled_autocast_around_an_unconverted_model_warns_once(unused_warning_due):
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16))
    x = torch.randn(4, 16)
    with pytest.warns(autocast_module.UnusedAutocastWarning, match=r"fc.convert") as seen:
        for _ in range(3):
            with fc.autocast(recipe=fc.Float8CurrentScaling()):
                plain(x)
    assert len(seen) == 1  # one cause, one warning
    assert seen[0].filename == __file__  # it points at the user's `with`


def test_no_warning_when_a_layer_ran_at_any_level(unused_warning_due):
    import warnings  # noqa: PLC0415

    model = fc.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    x, r = torch.randn(4, 16), fc.Float8CurrentScaling()
    with warnings.catch_warnings():
        warnings.simplefilter("error", autocast_module.UnusedAutocastWarning)
        with fc.autocast(recipe=r):
            model(x)
        with fc.autocast(recipe=r):  # the layer ran in an inner level only
            with fc.autocast(False, recipe=r):
                with fc.autocast(recipe=r):
                    model(x)
        with fc.autocast(False, recipe=r):  # disabled: nothing was asked to run in FP8
            pass
        with fc.autocast(recipe=r):
            torch.nn.Linear(16, 16)(x)  # unconverted, but the outer level decides ...
            with fc.autocast(recipe=r):
                model(x)
    # ... and a layer that ran only under a disabled level is not quantized: warned.
    with pytest.warns(autocast_module.UnusedAutocastWarning):
        with fc.autocast(recipe=r):
            with fc.autocast(False, recipe=r):
                model(x)


def test_one_refresh_applies_both_environment_settings(monkeypatch):
    from fastcast.kernels import choice  # noqa: PLC0415

    x = torch.empty(1)
    monkeypatch.setenv("FASTCAST_KERNELS", "reference")
    hardware.refresh()
    try:
        assert choice.fused_op("quantize_tensorwise", x) is None  # the reference runs
        monkeypatch.setenv("FASTCAST_KERNELS", "bogus")
        hardware.refresh()
        with pytest.raises(ValueError, match="FASTCAST_KERNELS"):
            choice.fused_op("quantize_tensorwise", x)
    finally:
        monkeypatch.undo()
        hardware.refresh()
