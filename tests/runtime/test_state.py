"""The state manager: autocast keys, per-thread state, step claims."""

from __future__ import annotations

import contextvars
import gc
import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastcast as fc
from fastcast.runtime import state
from fastcast.runtime.state import OUTSIDE, ThreadState, autocast_key
from fastcast.schemes.delayed import DelayedThreadState


class Group:
    """Stands in for a process group: weak-referenceable, compared by identity."""


class SlottedGroup:
    """A group object that does not support weak references."""

    __slots__ = ()


def _named_callable(qualname: str, text: str | None = None):
    """A callable whose ``__qualname__`` (and repr) is chosen by an adversary."""

    class Factory:
        def __call__(self, role):
            return role

        def __repr__(self):
            return text if text is not None else qualname

    f = Factory()
    f.__qualname__ = qualname
    return f


def _adversarial_recipes():
    delayed = fc.DelayedScaling()
    current = fc.Float8CurrentScaling()
    mimics = [
        repr(delayed),
        repr(current),
        f"{delayed!r}|0",
        f"{delayed!r}|1",
        "x|1",
        "x",
        "|",
        ",",
        ")",
        "), group=1",
        "a, b)",
        "<quantizer_factory at 0x1>",
    ]
    customs = [fc.CustomRecipe(_named_callable(m)) for m in mimics]
    # Two factories with identical qualname *and* repr, still different objects.
    customs += [fc.CustomRecipe(_named_callable("twin", "twin")) for _ in range(2)]

    def plain(role):
        return role

    plain.__qualname__ = repr(delayed)
    customs.append(fc.CustomRecipe(plain))
    return [delayed, current, fc.DelayedScaling(margin=1), *customs]


# --------------------------------------------------------------------------- keys


def test_equal_recipes_give_equal_keys():
    for make in (
        lambda: fc.DelayedScaling(margin=1, amax_history_len=8),
        lambda: fc.Float8CurrentScaling(),
        lambda: fc.Float8BlockScaling(use_f32_scales=True),
        lambda: fc.MXFP8BlockScaling(),
        lambda: fc.NVFP4BlockScaling(),
    ):
        a, b = make(), make()
        assert a is not b
        assert autocast_key(a) == autocast_key(b) == autocast_key(a, None)
        assert hash(autocast_key(a)) == hash(autocast_key(b))
        assert {autocast_key(a): 1}[autocast_key(b)] == 1
    assert autocast_key(None) == autocast_key(None, None)


def test_adversarial_reprs_never_collide():
    recipes = _adversarial_recipes()
    # The adversarial factories really do print like other recipes.
    assert repr(recipes[0]) in repr(recipes[3])
    groups = [None, Group(), Group(), SlottedGroup()]
    pairs = list(itertools.product(recipes, groups))
    keys = [autocast_key(r, g) for r, g in pairs]
    assert len(set(keys)) == len(pairs)
    for (pa, ka), (pb, kb) in itertools.combinations(zip(pairs, keys), 2):
        assert ka != kb, (pa, pb)
    # Keys are stable: recomputing gives equal keys.
    assert keys == [autocast_key(r, g) for r, g in pairs]


def test_held_key_never_matches_a_later_recipe():
    # Build recipes around short-lived callables that all share one qualname: as soon as
    # one is freed its address (and so an id-based repr) can be handed to the next. A key
    # that is still held must never equal the key of a later, different recipe.
    def make_factory():
        def factory(role):
            return role

        return factory

    held = autocast_key(fc.CustomRecipe(make_factory()))
    later = set()
    for _ in range(200):
        key = autocast_key(fc.CustomRecipe(make_factory()))
        assert key != held
        later.add(repr(key))
        gc.collect(0)
    # The later recipes did reuse addresses among themselves (same repr, so a repr-based
    # key would have aliased them); the held one was kept distinct.
    assert len(later) < 200


def test_distinct_groups_give_distinct_keys_same_group_same_key():
    r = fc.DelayedScaling()
    g1, g2 = Group(), Group()
    assert autocast_key(r, g1) == autocast_key(r, g1)
    assert autocast_key(r, g1) != autocast_key(r, g2)
    assert autocast_key(r, g1) != autocast_key(r, None)
    assert autocast_key(r, g1) != autocast_key(fc.Float8CurrentScaling(), g1)
    # A recipe equal by value shares the key for the same group.
    assert autocast_key(fc.DelayedScaling(), g1) == autocast_key(r, g1)


@pytest.mark.parametrize(
    "make_group",
    [Group, SlottedGroup, lambda: tuple(range(3))],
    ids=["weakref", "slots", "equal-tuples"],
)
def test_group_kinds(make_group):
    # Weak-referenceable or not, and even equal by value (tuples): distinct objects are
    # distinct groups, and one object always gives the same key.
    r = fc.DelayedScaling()
    a, b = make_group(), make_group()
    assert a is not b
    key_a = autocast_key(r, a)
    assert autocast_key(r, a) == key_a
    assert autocast_key(r, b) != key_a


def test_unhashable_group_works():
    r = fc.DelayedScaling()
    a, b = [], []  # neither hashable nor weak-referenceable
    assert autocast_key(r, a) == autocast_key(r, a)
    assert autocast_key(r, a) != autocast_key(r, b)


@pytest.mark.parametrize("group_type", [Group, SlottedGroup], ids=lambda t: t.__name__)
def test_freed_group_id_is_never_aliased(group_type):
    r = fc.DelayedScaling()
    # Create and free groups one after another: CPython hands a freed address to the
    # next object of the same size, so ids repeat; keys must not.
    keys, ids = set(), []
    for _ in range(200):
        group = group_type()
        ids.append(id(group))
        key = autocast_key(r, group)
        assert key == autocast_key(r, group)
        assert key not in keys
        keys.add(key)
        del group
        gc.collect(0)
    if group_type is Group:
        assert len(set(ids)) < len(ids), "no id was reused: the test proved nothing"


def test_distinct_groups_that_compare_equal_get_distinct_keys():
    class ValueGroup:
        def __init__(self, ranks):
            self.ranks = ranks

        def __eq__(self, other):
            return isinstance(other, ValueGroup)

        def __hash__(self):
            return 0

    r = fc.DelayedScaling()
    a, b = ValueGroup([0, 1]), ValueGroup([2, 3])
    assert autocast_key(r, a) != autocast_key(r, b)


def test_group_serials_are_thread_safe():
    r = fc.DelayedScaling()
    shared = Group()
    n = 8
    barrier = threading.Barrier(n, timeout=10)
    shared_keys, own_keys, errors = [], [], []

    def worker():
        try:
            own = Group()
            barrier.wait()
            for _ in range(50):
                shared_keys.append(autocast_key(r, shared))
            own_keys.append((own, autocast_key(r, own)))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not errors
    assert len(set(shared_keys)) == 1 and len(shared_keys) == 50 * n
    assert len({k for _, k in own_keys} | set(shared_keys)) == n + 1


def test_frame_key_matches_autocast_key():
    r, g = fc.Float8CurrentScaling(), Group()
    with fc.autocast(recipe=r, amax_reduction_group=g) as ac:
        assert ac.key() == autocast_key(r, g)
        assert ac.key() is ac.key()  # computed once per frame
        with fc.autocast(recipe=fc.Float8CurrentScaling()) as inner:
            assert inner.key() == autocast_key(r, None) != ac.key()


# --------------------------------------------------------------------------- thread state


def test_fresh_thread_state():
    ts = ThreadState()
    assert ts.schemes == {}  # no stateful scheme has run in it
    assert ts.thread is threading.current_thread()
    assert DelayedThreadState.of(ts) is DelayedThreadState.of(ts)  # made once per thread


def test_outside_frame():
    assert OUTSIDE.enabled is False and OUTSIDE.recipe is None
    assert OUTSIDE.calibrating is False and OUTSIDE.active is False
    assert state.current_frame() is OUTSIDE
    assert fc.is_autocast_enabled() is False and fc.get_autocast_recipe() is None


def test_thread_state_is_per_thread():
    main = state.thread_state()
    assert state.thread_state() is main
    seen = []

    def worker():
        ts = state.thread_state()
        seen.append((ts, state.thread_state() is ts, state.current_frame()))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(seen) == 2
    (ts1, same1, frame1), (ts2, same2, frame2) = seen
    assert same1 and same2
    assert ts1 is not main and ts2 is not main and ts1 is not ts2
    assert frame1 is OUTSIDE and frame2 is OUTSIDE


def test_active_and_opens_step():
    r = fc.DelayedScaling()
    with fc.autocast(recipe=r) as outer:
        assert outer.active and outer.opens_step()
        with fc.autocast(recipe=r) as inner:
            assert inner.active and not inner.opens_step()
        with fc.autocast(enabled=False, recipe=r) as off:
            assert not off.active
    with fc.autocast(enabled=False, recipe=r, calibrating=True) as calib:
        assert calib.active and calib.opens_step()


def test_reenabled_level_inside_a_step_does_not_open_another():
    r = fc.DelayedScaling()
    with fc.autocast(recipe=r) as outer:
        assert outer.opens_step()
        with fc.autocast(enabled=False, recipe=r):
            with fc.autocast(recipe=r) as inner:
                assert not inner.opens_step()


def test_stateful_thread_count_follows_live_threads():
    """``stateful_threads`` counts thread states that hold a stateful scheme's state:
    it goes back down when such a thread ends (it only grew before)."""
    import gc  # noqa: PLC0415

    gc.collect()
    before = state.autocast_state.stateful_threads

    def worker():
        DelayedThreadState.of(state.thread_state())
        seen.append(state.autocast_state.stateful_threads)

    seen = []
    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(seen) == 3 and max(seen) > before
    del threads, t
    gc.collect()
    assert state.autocast_state.stateful_threads == before


# -- per-context permissions and tokens --------------------------------------------------------


def test_unsafe_permission_held_by_a_generator_is_taken_back_wherever_it_closes():
    def holder():
        with fc.allow_unsafe_extra_state():
            yield

    for close_in in ("context", "thread"):
        first = contextvars.Context()
        gen = holder()
        first.run(next, gen)
        assert first.run(state.unsafe_extra_state_allowed)
        if close_in == "context":
            contextvars.Context().run(gen.close)
        else:
            t = threading.Thread(target=gen.close)
            t.start()
            t.join(10)
        assert not first.run(state.unsafe_extra_state_allowed), close_in
        assert not state.unsafe_extra_state_allowed()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 2), st.booleans()), max_size=25))
def test_unsafe_permission_matches_a_model_across_two_contexts(ops):
    """Enters and exits of three instances spread over two contexts: each context allows
    exactly while a permission entered in it is open, and an exit closes the innermost
    open entry of its instance this context sees, else that instance's latest anywhere."""
    contexts = [contextvars.Context(), contextvars.Context()]
    instances = [fc.allow_unsafe_extra_state() for _ in range(3)]
    opened: list[list] = []  # [instance index, context index, open], in entry order
    for c, i, enter in ops:
        if enter:
            contexts[c].run(instances[i].__enter__)
            opened.append([i, c, True])
            continue
        mine = [p for p in opened if p[0] == i and p[2]]
        if not mine:
            continue
        here = [p for p in mine if p[1] == c]
        (here or mine)[-1][2] = False
        contexts[c].run(instances[i].__exit__, None, None, None)
        for k in (0, 1):
            want = any(p[1] == k and p[2] for p in opened)
            assert contexts[k].run(state.unsafe_extra_state_allowed) is want
    assert not state.unsafe_extra_state_allowed()


def test_autocast_exit_from_a_copied_context_is_refused_and_changes_nothing():
    ac = fc.autocast(recipe=fc.Float8CurrentScaling())
    with ac:
        copied = contextvars.copy_context()  # sees ac, but did not enter it
        with pytest.raises(RuntimeError, match="not active here"):
            copied.run(ac.__exit__, None, None, None)
        assert copied.run(state.current_frame) is ac
        assert state.current_frame() is ac
    assert state.current_frame() is OUTSIDE
