"""Pins what ``fastcast.nn.torch_checkpoint`` reads of torch: in both checkpoint modes the
adapter finds one object per region, the same in the original forward and in its
recomputation, and finds none outside a region (plain no-grad code, plain backward).
A torch that changes its checkpoint internals fails here, by name, before any layer
recomputes in the wrong precision."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fastcast.nn import torch_checkpoint


def _probed(seen: list) -> object:
    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch_checkpoint.region(active=True))
        return x * x  # saves x: the backward needs the recomputation

    return fn


@pytest.mark.parametrize("reentrant", [False, True])
def test_each_region_is_found_in_its_forward_and_its_recomputation(reentrant):
    seen: list = []
    x = torch.randn(4, requires_grad=True)
    a = checkpoint(_probed(seen), x, use_reentrant=reentrant)
    b = checkpoint(_probed(seen), x, use_reentrant=reentrant)
    (a + b).sum().backward()
    assert len(seen) == 4, seen  # two forwards, two recomputations
    forwards, recomputations = seen[:2], seen[2:]
    assert all(found is not None and found[1] is False for found in forwards)
    assert all(found is not None and found[1] is True for found in recomputations)
    regions = [found[0] for found in forwards]
    assert regions[0] is not regions[1]  # one object per region
    # Backward runs the second region first: each recomputation finds its own region.
    assert {id(found[0]) for found in recomputations} == {id(r) for r in regions}
    assert x.grad is not None and torch.allclose(x.grad, 4 * x.detach())


def test_the_facts_read_from_torch_still_hold():
    from torch.utils import checkpoint as module  # noqa: PLC0415

    # The non-reentrant hooks: their qualified names and the closure variables read.
    init_codes = {
        c.co_name: c
        for c in module._checkpoint_hook.__init__.__code__.co_consts
        if hasattr(c, "co_freevars")
    }
    assert "frame" in init_codes["pack_hook"].co_freevars
    recompute_codes = [
        c
        for c in module._recomputation_hook.__init__.__code__.co_consts
        if hasattr(c, "co_freevars")
    ]
    assert any("target_frame_ref" in c.co_freevars for c in recompute_codes)
    # The reentrant forward keeps its node as the local ``ctx``.
    assert "ctx" in module.CheckpointFunction.forward.__code__.co_varnames


def test_no_region_outside_a_checkpoint():
    seen: list = []
    x = torch.randn(4, requires_grad=True)
    assert torch_checkpoint.region(active=True) is None
    with torch.no_grad():  # plain no-grad code (inference) is no region
        _probed(seen)(x)

    class Probe(torch.autograd.Function):  # a forward run inside a plain backward
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            with torch.enable_grad():
                _probed(seen)(torch.ones(2, requires_grad=True))
            return g

    Probe.apply(x).sum().backward()
    assert seen == [None, None]


def test_inference_mode_walks_no_stack_and_keeps_non_reentrant_regions(monkeypatch):
    """Under ``torch.inference_mode`` no region can be recomputed: the reentrant search
    (a walk up the Python stack) does not run. A non-reentrant region whose function
    enters inference mode is still found (its hooks are read first), in its forward and
    its recomputation alike."""
    calls: list = []
    monkeypatch.setattr(torch_checkpoint, "_reentrant_forward", lambda: calls.append(1))
    x = torch.randn(4, requires_grad=True)
    with torch.inference_mode():
        assert torch_checkpoint.region(active=True) is None
        checkpoint(_probed([]), x, use_reentrant=True)
    assert calls == []
    with torch.no_grad():  # plain no-grad code still looks (a reentrant forward's mode)
        torch_checkpoint.region(active=True)
    assert calls == [1]

    seen: list = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            seen.append(torch_checkpoint.region(active=True))
        return t * t

    checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert [found[1] for found in seen] == [False, True]
    assert seen[0][0] is seen[1][0]
