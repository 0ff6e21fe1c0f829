"""fastcast under real training code: activation checkpointing in both modes, unused
branches, autocast stacks across threads, tasks, generators and copied contexts."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastcast as fc
from fastcast.runtime import state
from fastcast.runtime.state import OUTSIDE


def in_thread(fn, *args):
    """Run ``fn`` in a new thread (fresh autocast stack and delayed-scaling state)."""
    out, err = [], []

    def run():
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=120)
    if err:
        raise err[0]
    return out[0]


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, ckpt=None, depth=2, width=32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 32)
        self.ckpt = ckpt  # None, or use_reentrant

    def forward(self, x):
        for block in self.blocks:
            if self.ckpt is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.ckpt)
        return self.head(x)


def _train(recipe, ckpt, steps=3, seed=0, backward_inside=False):
    torch.manual_seed(seed)
    model = fc.convert(Net(ckpt))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step in range(steps):
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with fc.autocast(recipe=recipe):
            loss = model(x).square().mean()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()  # recomputation runs here, after the autocast exited
        grads.append([p.grad.clone() for p in model.parameters()] + [x.grad.clone()])
        opt.step()
        opt.zero_grad()
    scales = [
        m._scheme_state[d].scale.clone()
        for m in model.modules()
        if isinstance(m, fc.Linear)
        for d in sorted(m._scheme_state)
    ]
    return grads, scales


RECIPES = {
    "delayed": lambda: fc.DelayedScaling(amax_history_len=4),
    "current": fc.Float8CurrentScaling,
    "mxfp8": fc.MXFP8BlockScaling,
    "rowwise-gw-hp": lambda: fc.Float8RowwiseScaling(wgrad_high_precision=True),
}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_checkpointing_needs_no_argument_and_changes_nothing(name, reentrant):
    plain_grads, plain_scales = in_thread(_train, RECIPES[name](), None)
    grads, scales = in_thread(_train, RECIPES[name](), reentrant)
    for a, b in zip(plain_grads, grads):
        for ga, gb in zip(a, b):
            assert torch.equal(ga, gb)
    for a, b in zip(plain_scales, scales):
        assert torch.equal(a, b)


def test_recomputation_is_not_high_precision():
    """Recomputed in backward, outside the autocast, a layer still runs in FP8."""

    def grads(recipe, ckpt):
        torch.manual_seed(3)
        lin = fc.Linear(32, 32)
        x = torch.randn(8, 32, requires_grad=True)
        with fc.autocast(enabled=recipe is not None, recipe=recipe or fc.Float8CurrentScaling()):
            y = lin(x) if ckpt is None else checkpoint(lin, x, use_reentrant=ckpt)
        y.square().sum().backward()
        return x.grad

    fp8 = grads(fc.Float8CurrentScaling(), None)
    assert not torch.equal(fp8, grads(None, None))
    for reentrant in (False, True):
        assert torch.equal(grads(fc.Float8CurrentScaling(), reentrant), fp8)


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}], ids=["defaults", "reentrant"])
def test_hugging_face_gradient_checkpointing(kwargs):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )

    def run(gc):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        fc.convert(model)
        model.train()
        if gc:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        with fc.autocast(recipe=fc.Float8CurrentScaling()):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, ckpt = in_thread(run, False), in_thread(run, True)
    assert plain.keys() == ckpt.keys() and any("mlp" in n for n in plain)
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=0, atol=0, msg=n)


def test_backward_scales_update_when_the_first_module_is_unused():
    def run():
        torch.manual_seed(0)
        aux, main = fc.Linear(16, 16), fc.Linear(16, 16)
        for _ in range(3):
            x = torch.randn(8, 16, requires_grad=True)
            with fc.autocast(recipe=fc.DelayedScaling(amax_history_len=2)):
                aux(x)  # an auxiliary head whose output is not used: its backward never runs
                y = main(x)
            y.sum().backward()
        return main._scheme_state[1].scale.clone(), main.weight.grad.clone()

    scale, wgrad = in_thread(run)
    assert scale.item() != 1.0 and torch.isfinite(scale).all()
    assert wgrad.abs().sum() > 0


def test_weight_cache_sees_replaced_storage():
    lin = fc.Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.no_grad(), fc.autocast(recipe=fc.Float8CurrentScaling()):
        lin(x, is_first_microbatch=True)
        lin.weight.data = torch.randn(16, 16)
        cached = lin(x, is_first_microbatch=False)
        fresh = lin(x)
    assert torch.equal(cached, fresh)


def test_delayed_module_used_by_two_live_threads_is_refused():
    lin = fc.Linear(16, 16)
    started, release = threading.Event(), threading.Event()

    def hold():
        with fc.autocast(recipe=fc.DelayedScaling()):
            lin(torch.randn(4, 16))
        started.set()
        release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert started.wait(30)
        with pytest.raises(RuntimeError, match="in use by thread"):
            in_thread(_run_delayed, lin)
    finally:
        release.set()
        t.join(30)
    in_thread(_run_delayed, lin)  # the other thread is gone: the module may move
    in_thread(_run_delayed, copy.deepcopy(lin))


def _run_delayed(lin):
    with fc.autocast(recipe=fc.DelayedScaling()):
        return lin(torch.randn(4, 16))


# -- the autocast stack ------------------------------------------------------------------------


def test_out_of_order_exit_is_refused_and_repaired():
    a, b = fc.autocast(recipe=fc.DelayedScaling()), fc.autocast(recipe=fc.Float8CurrentScaling())
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        a.__exit__(None, None, None)
    assert state.current_frame() is OUTSIDE
    with pytest.raises(RuntimeError, match="not active here"):
        b.__exit__(None, None, None)
    assert state.current_frame() is OUTSIDE and not fc.is_autocast_enabled()


def test_an_error_in_the_update_leaves_no_level_active():
    def run():
        def boom(amax, scale, fmt_max, recipe):
            raise ArithmeticError("boom")

        ac = fc.autocast(recipe=fc.DelayedScaling(scaling_factor_compute_algo=boom))
        lin = fc.Linear(16, 16)
        with pytest.raises(ArithmeticError):
            with ac:
                lin(torch.randn(4, 16, requires_grad=True))
        assert state.current_frame() is OUTSIDE
        with ac:  # can be entered again
            assert state.current_frame() is ac

    in_thread(run)


def test_arguments_are_checked_at_construction():
    with pytest.raises(TypeError, match="keyword-only"):
        fc.autocast("cuda")
    with pytest.raises(TypeError):
        fc.autocast(True, fc.Float8CurrentScaling())  # positional recipe
    with pytest.raises(TypeError, match="fastcast recipe"):
        fc.autocast(recipe="delayed")
    with pytest.raises(TypeError, match="calibrating"):
        fc.autocast(recipe=fc.DelayedScaling(), calibrating=1)


def test_asyncio_tasks_are_isolated_and_to_thread_inherits():
    r = fc.Float8CurrentScaling()

    async def holder(entered, done):
        with fc.autocast(recipe=r):
            entered.set()
            await done.wait()
            return fc.get_autocast_recipe()

    async def other(entered):
        await entered.wait()
        return fc.get_autocast_recipe()

    async def main():
        entered, done = asyncio.Event(), asyncio.Event()
        h = asyncio.create_task(holder(entered, done))
        seen_by_other = await asyncio.create_task(other(entered))
        with fc.autocast(recipe=r):
            in_worker = await asyncio.to_thread(fc.get_autocast_recipe)
        done.set()
        return seen_by_other, in_worker, await h, fc.get_autocast_recipe()

    seen_by_other, in_worker, in_holder, after = asyncio.run(main())
    assert seen_by_other is None and in_worker is r and in_holder is r and after is None


def test_copied_contexts_and_threads_never_leak_back():
    r = fc.Float8CurrentScaling()

    def enter_and_leave_open():
        fc.autocast(recipe=r).__enter__()
        return fc.get_autocast_recipe()

    with fc.autocast(recipe=fc.DelayedScaling()) as outer:
        ctx = contextvars.copy_context()
        threads = [
            threading.Thread(target=ctx.copy().run, args=(enter_and_leave_open,)) for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert ctx.run(enter_and_leave_open) is r
        assert state.current_frame() is outer
    assert state.current_frame() is OUTSIDE


def test_generator_holding_an_autocast_is_detected_at_exit():
    def gen(recipe):
        with fc.autocast(recipe=recipe):
            yield fc.get_autocast_recipe()
            yield fc.get_autocast_recipe()

    r1, r2 = fc.Float8CurrentScaling(), fc.DelayedScaling()
    g1, g2 = gen(r1), gen(r2)
    assert next(g1) is r1 and next(g2) is r2
    assert next(g1) is r2  # per context, as torch.autocast is per thread: documented
    with pytest.raises(RuntimeError, match="out of order"):
        next(g1)  # g1's exit while g2's level is above it
    assert state.current_frame() is OUTSIDE
    with pytest.raises(RuntimeError, match="not active here"):
        g2.close()  # its level went with g1's
    assert state.current_frame() is OUTSIDE


def test_unsafe_extra_state_permission_follows_the_context():
    allowed = state.unsafe_extra_state_allowed

    async def main():
        entered, done = asyncio.Event(), asyncio.Event()

        async def a():
            with fc.allow_unsafe_extra_state():
                entered.set()
                await done.wait()

        async def b():
            await entered.wait()
            return allowed()

        ta = asyncio.create_task(a())
        other = await asyncio.create_task(b())
        done.set()
        await ta
        return other, await asyncio.to_thread(allowed)

    assert asyncio.run(main()) == (False, False)
    with fc.allow_unsafe_extra_state():
        assert in_thread(allowed) is False  # a plain thread starts with nothing
        assert contextvars.copy_context().run(allowed) is True
    assert not allowed()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=20))
def test_any_enter_exit_sequence_keeps_the_stack_consistent(ops):
    """Random enters and exits (in or out of order) against a model stack: after each,
    the current frame is the model's top, and errors come exactly where the model says."""
    instances = [fc.autocast(recipe=fc.Float8CurrentScaling()) for _ in range(4)]
    model: list = []
    try:
        for enter, i in ops:
            ac = instances[i]
            if enter:
                if ac in model:
                    with pytest.raises(RuntimeError, match="already active"):
                        ac.__enter__()
                else:
                    ac.__enter__()
                    model.append(ac)
            elif model and model[-1] is ac:
                ac.__exit__(None, None, None)
                model.pop()
            elif ac in model:
                with pytest.raises(RuntimeError, match="out of order"):
                    ac.__exit__(None, None, None)
                del model[model.index(ac) :]
            else:
                with pytest.raises(RuntimeError, match="not active"):
                    ac.__exit__(None, None, None)
            assert state.current_frame() is (model[-1] if model else OUTSIDE)
    finally:
        state.set_stack(state.BOTTOM)
