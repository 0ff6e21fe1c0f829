"""``fc.autocast``'s C hot path (``fastcast/runtime/_native.c``) against its Python reference.

The C construction, ``__enter__`` and ``__exit__`` must do exactly what the Python methods
do: the tests run the same programs with the C construction on and off and compare
everything a user can observe (state, results, errors and their messages).
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import shutil
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastcast as fc
from fastcast.runtime import state

autocast_module = importlib.import_module("fastcast.autocast")
native = autocast_module._native
NativeAutocast = autocast_module.NativeAutocast

needs_native = pytest.mark.skipif(native is None, reason="fastcast.runtime._native not built")

RECIPES = [fc.DelayedScaling(), fc.Float8CurrentScaling(), fc.MXFP8BlockScaling(), None]


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


@pytest.mark.skipif(_compiler() is None, reason="no C compiler: the install skips the build")
def test_the_install_built_the_c_hot_path():
    assert native is not None, "pip install should have built fastcast.runtime._native"
    assert native.fast_construction()


@needs_native
@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("enabled", [True, False])
def test_the_usual_call_is_built_in_c_and_behaves_as_the_reference(recipe, enabled):
    fc.autocast(recipe=recipe)  # the first call of a new recipe type goes through Python
    made = fc.autocast(enabled, recipe=recipe, calibrating=not enabled)
    by_keyword = fc.autocast(enabled=enabled, recipe=recipe)
    assert type(made) is NativeAutocast and type(by_keyword) is NativeAutocast
    assert isinstance(made, fc.autocast)
    expected = recipe if recipe is not None else autocast_module.default_recipe()
    assert made.recipe is expected and made.enabled is enabled
    assert made.calibrating is (not enabled) and made.group is None and made.ran is False
    with made as entered:
        assert entered is made
        assert fc.get_autocast_recipe() is expected
        assert fc.is_autocast_enabled() is enabled
    assert fc.get_autocast_recipe() is None and not fc.is_autocast_enabled()


@needs_native
@pytest.mark.parametrize(
    "call",
    [
        lambda: fc.autocast(1),
        lambda: fc.autocast(True, fc.DelayedScaling()),
        lambda: fc.autocast(recipe="delayed"),
        lambda: fc.autocast(calibrating=None),
        lambda: fc.autocast(True, enabled=True),
        lambda: fc.autocast(recipes=fc.DelayedScaling()),
    ],
    ids=["int", "positional", "str-recipe", "none-calibrating", "twice", "unknown-keyword"],
)
def test_unusual_calls_fail_with_the_reference_message(call):
    errors = []
    for on in (True, False):
        native.set_fast_construction(on)
        try:
            with pytest.raises(TypeError) as caught:
                call()
            errors.append(str(caught.value))
        finally:
            native.set_fast_construction(True)
    assert errors[0] == errors[1]


def _run(program: list[tuple], fast: bool) -> list:
    """Run ``program`` (ops on up to 3 autocasts) and return what a user observes."""
    if native is not None:
        native.set_fast_construction(fast)
    seen: list = []
    made: list = []
    entered: list = []
    try:
        for op, *args in program:
            try:
                if op == "new":
                    enabled, index = args
                    made.append(fc.autocast(enabled, recipe=RECIPES[index]))
                    seen.append("new")
                elif op == "enter" and made:
                    cm = made[args[0] % len(made)]
                    cm.__enter__()
                    entered.append(cm)
                    seen.append("entered")
                elif op == "exit" and made:
                    cm = made[args[0] % len(made)]
                    failing = args[1]
                    exc = (ValueError, ValueError("x"), None) if failing else (None, None, None)
                    seen.append(("exit", cm.__exit__(*exc)))
                seen.append((fc.get_autocast_recipe(), fc.is_autocast_enabled()))
            except RuntimeError as error:
                seen.append(("error", str(error)))
                seen.append((fc.get_autocast_recipe(), fc.is_autocast_enabled()))
    finally:
        while state.get_stack()[1] is not None:  # leave the context as found
            state.reset_stack(state.get_stack()[2])
        if native is not None:
            native.set_fast_construction(True)
    return seen


ops = st.one_of(
    st.tuples(st.just("new"), st.booleans(), st.integers(0, len(RECIPES) - 1)),
    st.tuples(st.just("enter"), st.integers(0, 2)),
    st.tuples(st.just("exit"), st.integers(0, 2), st.booleans()),
)


@needs_native
@settings(max_examples=150, deadline=None)
@given(st.lists(ops, max_size=12))
def test_any_program_observes_the_same_as_the_reference(program):
    """Nesting, re-entry of an active instance, exits out of order, twice or never
    entered, exits with exceptions: the same states, results and error messages."""
    assert _run(program, fast=True) == _run(program, fast=False)


@pytest.mark.parametrize("fast", [True, False])
def test_exit_in_another_context_is_refused_in_both(fast):
    if native is None and fast:
        pytest.skip("fastcast.runtime._native not built")
    if native is not None:
        native.set_fast_construction(fast)
    try:
        cm = fc.autocast(recipe=fc.Float8CurrentScaling())
        cm.__enter__()
        ctx = contextvars.copy_context()  # a copy sees the level, but not as its own
        with pytest.raises(RuntimeError, match="not active here"):
            ctx.run(cm.__exit__, None, None, None)
        assert fc.is_autocast_enabled()
        cm.__exit__(None, None, None)
        assert not fc.is_autocast_enabled()
    finally:
        if native is not None:
            native.set_fast_construction(True)


@needs_native
def test_tracing_ranges_cover_an_autocast_made_before_they_were_enabled():
    made = fc.autocast(recipe=fc.Float8CurrentScaling())
    assert type(made) is NativeAutocast
    fc.profiling.enable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with made:
                pass
    finally:
        fc.profiling.disable()
    names = {event.name for event in prof.events()}
    assert {"fastcast.autocast.enter", "fastcast.autocast.exit"} <= names


@needs_native
def test_inspection_steps_on_an_autocast_made_before_it_started():
    torch.manual_seed(0)
    model = fc.convert(torch.nn.Sequential(torch.nn.Linear(32, 32)))
    made = [fc.autocast(recipe=fc.Float8CurrentScaling()) for _ in range(2)]
    x = torch.randn(8, 32)
    with fc.inspect(model, every=1) as inspection:
        for cm in made:
            with cm:
                model(x).sum().backward()
        assert inspection.current_step == 1  # each outermost entry began a step
    assert {row["step"] for row in inspection.report().rows()} == {0, 1}


# -- the contract between autocast.py and _native.c ------------------------------------------


@needs_native
def test_the_python_table_and_the_c_roles_agree():
    # A role renamed, added or moved on either side fails here (and install refuses it).
    table = autocast_module.native_contract()
    assert tuple(role for role, _ in table) == native.ROLES
    # The keywords the C construction takes are autocast.__init__'s own.
    parameters = inspect.signature(autocast_module.autocast.__init__).parameters
    keywords = dict(table)["keywords"]
    assert all(parameters[k].kind in (k_.POSITIONAL_OR_KEYWORD, k_.KEYWORD_ONLY) for k in keywords)
    assert keywords == ("enabled", "recipe", "calibrating", "amax_reduction_group")
    # Slots come as member descriptors of the classes the C code reads them from.
    for role, obj in table:
        if role.startswith("slot_"):
            owner = state.AutocastFrame if role in FRAME_SLOTS else state.AutocastState
            assert owner.__dict__[obj.__name__] is obj, role


FRAME_SLOTS = ("slot_enabled", "slot_recipe", "slot_calibrating", "slot_group", "slot_ran")
k_ = inspect.Parameter


@needs_native
def test_install_refuses_a_table_that_drifted():
    table = list(autocast_module.native_contract())
    renamed = [*table[:3], ("stack_var", table[3][1]), *table[4:]]
    with pytest.raises(
        TypeError, match=r"entry 3 of the contract must be the role 'default_recipe'"
    ):
        native.install(tuple(renamed))
    with pytest.raises(TypeError, match=r"tuple of \d+ \(role, object\) pairs"):
        native.install(tuple(table[:-1]))
    not_a_slot = [*table[:8], ("slot_enabled", property(lambda self: True)), *table[9:]]
    with pytest.raises(TypeError, match=r"slot_enabled is not a slot"):
        native.install(tuple(not_a_slot))
    with pytest.raises(RuntimeError, match="installed already"):  # the good table: checked
        native.install(tuple(table))


def test_the_c_source_looks_up_no_python_name():
    # Every object comes from the table; a name looked up in C would be a second contract.
    source = (Path(autocast_module.__file__).parent / "runtime" / "_native.c").read_text()
    for call in ("GetAttrString", "InternFromString", "GetItemString", "CallMethod", "SetAttr("):
        assert call not in source, call


@needs_native
def test_the_c_exit_reads_the_shared_switches():
    # The C exit reads warning_due from the state manager's struct: switched off there,
    # an unused enabled autocast does not warn; switched on, it does.
    made = fc.autocast(recipe=fc.Float8CurrentScaling())
    assert type(made) is NativeAutocast
    due = state.autocast_state.warning_due
    try:
        state.autocast_state.warning_due = False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with made:
                pass
        state.autocast_state.warning_due = True
        with pytest.warns(autocast_module.UnusedAutocastWarning):
            with fc.autocast(recipe=fc.Float8CurrentScaling()):
                pass
        assert state.autocast_state.warning_due is False  # once per process
    finally:
        state.autocast_state.warning_due = due
