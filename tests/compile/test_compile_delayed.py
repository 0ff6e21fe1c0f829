"""DelayedScaling under ``torch.compile(fullgraph=True)``: a compiled model under an eager
``fc.autocast`` trains exactly as in eager (losses, gradients, amax histories, scales,
the number of updates); what is not supported is refused by name. Each compile costs
seconds here, so the tests are few."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import checkpoint

import fastcast as fc
from fastcast.schemes.delayed import BACKWARD, FORWARD, Slab

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]


@pytest.fixture
def update_counts(monkeypatch):
    """Updates per slab (other tests' slabs in this thread may update too)."""
    counts: dict[Slab, int] = {}
    update = Slab.update

    def counting(slab: Slab) -> None:
        counts[slab] = counts.get(slab, 0) + 1
        update(slab)

    monkeypatch.setattr(Slab, "update", counting)
    return counts


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return fc.convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))


def _train(model, run, xs, counts):
    """SGD steps, each under a fresh (equal) recipe entered in eager; the losses, the
    last gradients and how often the first layer's forward and backward slabs updated."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts.clear()
    losses = []
    for x in xs:
        opt.zero_grad()
        with fc.autocast(recipe=fc.DelayedScaling(amax_history_len=4)):
            loss = run(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    metas = next(m for m in model.modules() if isinstance(m, fc.Linear))._scheme_state
    updates = [counts.get(metas[direction].slab, 0) for direction in (FORWARD, BACKWARD)]
    return losses, [p.grad.clone() for p in model.parameters()], updates


def _assert_same_training(got, want, got_model, want_model):
    assert got[2] == want[2]  # as many forward and backward updates
    for g, w in zip(got[0], want[0]):
        assert torch.equal(g, w)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    layers = [(a, b) for a, b in zip(got_model.modules(), want_model.modules())]
    layers = [(a, b) for a, b in layers if isinstance(a, fc.Linear)]
    assert layers
    for a, b in layers:
        got_state = fc.read_extra_state(a.get_extra_state())
        want_state = fc.read_extra_state(b.get_extra_state())
        for direction in ("forward", "backward"):
            for name in ("amax_history", "scale"):
                assert torch.equal(got_state[direction][name], want_state[direction][name])


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
def test_compiled_model_under_eager_delayed_autocast_trains_as_eager(update_counts):
    model, xs = _mlp(), [torch.randn(32, 64) * (i + 1) for i in range(6)]
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)

    want = _train(eager, eager, xs[:3], update_counts)
    got = _train(model, compiled, xs[:3], update_counts)
    assert want[2] == [3, 3]  # a forward and a backward update per step
    _assert_same_training(got, want, model, eager)
    assert counter.frame_count == 1  # equal recipes, moving scales: one graph

    # Another layer joins the same slabs (they grow, the views move): the graph follows.
    joining = fc.convert(nn.Sequential(nn.Linear(64, 64)))
    with fc.autocast(recipe=fc.DelayedScaling(amax_history_len=4)):
        joining(xs[0]).sum().backward()
    # A checkpoint load gives the layers new metas: traced (and joined) again.
    model.load_state_dict(eager.state_dict())
    want = _train(eager, eager, xs[3:], update_counts)
    got = _train(model, compiled, xs[3:], update_counts)
    _assert_same_training(got, want, model, eager)
    assert counter.frame_count == 2


def test_calibrating_a_compiled_model_records_as_eager():
    model, x = _mlp(), torch.randn(32, 64) * 3
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for m in (eager, compiled):
        with fc.autocast(False, recipe=fc.DelayedScaling(amax_history_len=4), calibrating=True):
            m(x)
    for a, b in zip(model.modules(), eager.modules()):
        if isinstance(a, fc.Linear):
            got = fc.read_extra_state(a.get_extra_state())["forward"]
            want = fc.read_extra_state(b.get_extra_state())["forward"]
            assert not torch.equal(want["scale"], torch.ones(2))  # calibration moved them
            assert torch.equal(got["scale"], want["scale"])
            assert torch.equal(got["amax_history"], want["amax_history"])


def test_what_compiled_delayed_scaling_refuses_names_the_way_out():
    model, x = _mlp(), torch.randn(32, 64)

    def autocast_inside(m, x):
        with fc.autocast(recipe=fc.DelayedScaling()):
            return m(x).sum()

    compiled = torch.compile(autocast_inside, backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="enter it in eager around the compiled model") as info:
        compiled(model, x)
    # fastcast's own message leads, not buried in Dynamo's "Observed exception" context.
    first_line = str(info.value).splitlines()[0]
    assert "fastcast: fc.autocast(recipe=DelayedScaling(...)) cannot be entered" in first_line
    assert "Observed exception" not in str(info.value)

    checkpointed = torch.compile(
        lambda m, x: checkpoint(m, x, use_reentrant=False), backend="eager", fullgraph=True
    )
    with fc.autocast(recipe=fc.DelayedScaling()):
        with pytest.raises(Exception, match="activation checkpointing.*Float8CurrentScaling"):
            checkpointed(model, x)

    frozen = _mlp().requires_grad_(False)
    with fc.autocast(recipe=fc.DelayedScaling()):
        with pytest.raises(Exception, match="requires grad.*Float8CurrentScaling"):
            torch.compile(frozen, backend="eager", fullgraph=True)(x.requires_grad_())
