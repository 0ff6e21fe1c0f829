"""``fc.convert(model, recipe=r, autocast=True)``: the model runs its own forward under
``fc.autocast(recipe=r)`` (trainers call the model themselves), computing exactly what
the same model computes inside a ``with fc.autocast(recipe=r)`` block, and nothing else
about the model changes."""

from __future__ import annotations

import copy
import inspect
import io
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastcast as fc
from fastcast.runtime import state

pytestmark = pytest.mark.usefixtures("single_thread")

RECIPE = fc.Float8CurrentScaling()


class Net(nn.Module):
    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 16)
        self.recompute = recompute

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if x.shape[-1] != 32:
            raise ValueError("Net takes 32 features")
        if self.recompute:
            hidden = checkpoint(lambda t: torch.relu(self.up(t)), x, use_reentrant=False)
        else:
            hidden = torch.relu(self.up(x))
        return self.down(hidden) * scale


def _net(recompute: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(recompute)


def _spy(model: Net) -> list:
    """(recipe, enabled) at each call of ``model.up``."""
    seen: list = []

    def hook(*_):
        seen.append((fc.get_autocast_recipe(), fc.is_autocast_enabled()))

    model.up.register_forward_pre_hook(hook)
    return seen


def _x() -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(1))


def test_forward_runs_under_the_recipe_as_a_with_block_would():
    model = fc.convert(_net(), recipe=RECIPE, autocast=True)
    seen = _spy(model)
    x = _x().requires_grad_()
    out = model(x, scale=2.0)
    out.sum().backward()
    assert seen == [(RECIPE, True)]
    assert not fc.is_autocast_enabled() and fc.get_autocast_recipe() is None

    reference = fc.convert(_net(), recipe=RECIPE)
    x_ref = _x().requires_grad_()
    with fc.autocast(recipe=RECIPE):
        expected = reference(x_ref, scale=2.0)
    expected.sum().backward()
    assert torch.equal(out, expected) and torch.equal(x.grad, x_ref.grad)
    assert torch.equal(model.up.weight.grad, reference.up.weight.grad)
    with torch.no_grad():
        assert not torch.equal(out, reference(_x(), scale=2.0))  # FP8 differs from FP32


def test_an_autocast_around_the_call_decides():
    model = fc.convert(_net(), recipe=RECIPE, autocast=True)
    seen = _spy(model)
    other = fc.Float8BlockScaling()
    with torch.no_grad():
        with fc.autocast(enabled=False):
            high = model(_x())
        with fc.autocast(recipe=other):
            model(_x())
    assert [enabled for _, enabled in seen] == [False, True]
    assert seen[1][0] == other
    assert torch.equal(high, fc.convert(_net())(_x()).detach())  # high precision, exactly


@pytest.mark.parametrize("recipe", [RECIPE, fc.DelayedScaling(amax_history_len=4)])
def test_an_exception_in_forward_leaves_the_autocast_state_as_it_was(recipe):
    model = fc.convert(_net(), recipe=recipe, autocast=True)
    before = state.get_stack()
    with pytest.raises(ValueError, match="takes 32 features"):
        model(torch.randn(4, 31))
    assert state.get_stack() is before and not fc.is_autocast_enabled()

    outer = fc.autocast(enabled=False)
    with outer:
        inside = state.get_stack()
        with pytest.raises(ValueError):
            model(torch.randn(4, 31))
        assert state.get_stack() is inside
    assert state.get_stack() is before
    seen = _spy(model)
    model(_x()).sum().backward()  # and the next step runs as usual
    assert seen == [(recipe, True)]


def test_threads_share_the_model_and_keep_their_own_state():
    """A forward paused in another thread (inside its autocast) changes nothing here."""
    model = fc.convert(_net(), recipe=RECIPE, autocast=True)
    inside, resume = threading.Event(), threading.Event()
    seen = []

    def pause(*_):
        seen.append(fc.get_autocast_recipe())
        inside.set()
        assert resume.wait(30)

    model.down.register_forward_pre_hook(pause)
    thread = threading.Thread(target=lambda: model(_x()))
    thread.start()
    try:
        assert inside.wait(30)
        assert not fc.is_autocast_enabled() and fc.get_autocast_recipe() is None
    finally:
        resume.set()
        thread.join(30)
    assert seen == [RECIPE]


def test_state_dict_signature_and_class_are_the_model_s_own():
    plain = _net()
    model = fc.convert(_net(), recipe=RECIPE, autocast=True)
    assert type(model) is Net
    assert list(model.state_dict()) == list(plain.state_dict())  # no key added
    model.load_state_dict(plain.state_dict())  # and a plain state dict loads strictly
    # The Hugging Face Trainer keeps the dataset columns the forward's signature names.
    assert inspect.signature(model.forward) == inspect.signature(plain.forward)
    assert model.forward.__self__ is model
    assert model.forward.__func__.function is Net.forward


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_run_their_own_forward_under_the_recipe(how):
    model = fc.convert(_net(), recipe=fc.DelayedScaling(amax_history_len=4), autocast=True)
    model(_x()).sum().backward()
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert copied.forward.__self__ is copied
    seen = _spy(copied)
    with torch.no_grad():
        assert torch.equal(copied(_x()), model(_x()))
    assert seen == [(model.forward.__func__.recipe, True)]
    copied.up.weight.data.zero_()  # the copy's own parameters
    assert model.up.weight.abs().sum() > 0


def test_converting_again_replaces_the_recipe_and_nests_nothing():
    model = fc.convert(_net(), recipe=RECIPE, autocast=True)
    other = fc.Float8BlockScaling()
    fc.convert(model, recipe=other, autocast=True)
    assert model.forward.__func__.function is Net.forward
    seen = _spy(model)
    model(_x())
    assert seen == [(other, True)]
    fc.convert(model, recipe=RECIPE)  # autocast=False leaves the wrapper alone
    assert model.forward.__func__.recipe == other


def test_activation_recomputation_replays_the_forward_s_recipe():
    """The recomputation runs in backward, after the model's autocast exited."""
    model = fc.convert(_net(recompute=True), recipe=RECIPE, autocast=True)
    model(_x()).sum().backward()
    reference = fc.convert(_net(), recipe=RECIPE)
    with fc.autocast(recipe=RECIPE):
        out = reference(_x())
    out.sum().backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, dict(reference.named_parameters())[name].grad), name


def test_an_autocast_given_is_the_one_each_call_runs_in():
    """``autocast=fc.autocast(...)``: its arguments (here calibration: high precision
    that records delayed-scaling amaxes) for every call."""
    recipe = fc.DelayedScaling(amax_history_len=4)
    calibrate = fc.autocast(enabled=False, calibrating=True, recipe=recipe)
    model = fc.convert(_net(), recipe=recipe, autocast=calibrate)
    frames = []
    model.up.register_forward_pre_hook(lambda *_: frames.append(state.current_frame()))
    with torch.no_grad():
        out = model(_x())
    (frame,) = frames
    assert (frame.enabled, frame.calibrating, frame.recipe) == (False, True, recipe)
    assert frame is not calibrate  # a fresh one per call, like it
    assert torch.equal(out, _net()(_x()).detach())  # in high precision
    saved = fc.read_extra_state(model.up.get_extra_state())
    assert saved["forward"]["amax_history"].abs().sum() > 0  # amaxes recorded
    # A process group cannot be pickled: a copy is refused with the reason, not broken.
    in_group = fc.autocast(recipe=RECIPE, amax_reduction_group=object())
    grouped = fc.convert(_net(), recipe=RECIPE, autocast=in_group)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.deepcopy(grouped)


def test_refusals_change_nothing():
    model = _net()
    with pytest.raises(TypeError, match="autocast must be a bool or an fc.autocast, got 'yes'"):
        fc.convert(model, recipe=RECIPE, autocast="yes")
    with pytest.raises(ValueError, match="runs another recipe than recipe="):
        fc.convert(model, recipe=RECIPE, autocast=fc.autocast(recipe=fc.Float8BlockScaling()))
    model.forward = lambda x: x  # not a method of the model (as torch.compile's would be)
    with pytest.raises(ValueError, match=r"Net\.forward was replaced by .*before wrapping"):
        fc.convert(model, recipe=RECIPE, autocast=True)
    assert type(model.up) is nn.Linear  # nothing was converted


def test_torch_compile_traces_the_wrapped_forward_whole():
    """Dynamo traces the wrapper and the autocast it enters in one graph (the eager
    backend: no Inductor compile)."""
    import torch._dynamo  # noqa: PLC0415

    torch._dynamo.reset()
    model = fc.convert(_net(), recipe=RECIPE, autocast=True)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    try:
        with torch.no_grad():
            assert torch.equal(compiled(_x()), model(_x()))
            with fc.autocast(enabled=False):  # another context: retraced, high precision
                assert torch.equal(compiled(_x()), fc.convert(_net())(_x()))
    finally:
        torch._dynamo.reset()
