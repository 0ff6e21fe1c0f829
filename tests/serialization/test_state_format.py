"""A stateful scheme saves its per-module state through a ``StateFormat`` it registers,
with no edit to the extra-state codec: a toy state (a step counter per module) makes the
round trip through ``state_dict``/``load_state_dict``, is validated before anything is
loaded, and the codec refuses what no format saves."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fastcast as fc
from fastcast.serialization import state_format
from fastcast.serialization.state_format import HEADER, StateFormat, register_state_format

KIND = 57  # a kind code no fastcast format uses


class Steps:
    """A toy ``ModuleState``: how many steps a module ran, as a float32 tensor."""

    def __init__(self, count: torch.Tensor) -> None:
        self.count = count

    @property
    def device(self) -> torch.device:
        return self.count.device

    def move_to(self, device: torch.device) -> None:
        self.count = self.count.to(device)

    def reset(self) -> None:
        self.count.zero_()


class StepsFormat(StateFormat):
    kind = KIND
    name = "steps"
    state_type = Steps

    def encode(self, module_state: dict[Any, Any]) -> tuple[dict[int, float], list[torch.Tensor]]:
        keys = sorted(module_state)
        return {4: float(len(keys))}, [torch.cat([module_state[k].count.float() for k in keys])]

    def decode(self, head: list[int], values: torch.Tensor, owner: str) -> dict[Any, Any]:
        if values.numel() != head[4] or not bool((values >= 0).all()):
            raise ValueError(f"{owner}: step counts must be {head[4]} values >= 0")
        return {i: Steps(values[i : i + 1].clone()) for i in range(head[4])}

    def view(self, module_state: dict[Any, Any]) -> dict[str, Any]:
        return {"counts": [module_state[k].count.item() for k in sorted(module_state)]}


@pytest.fixture
def steps_format():
    register_state_format(StepsFormat)
    try:
        yield
    finally:  # the registry is global: leave it as it was
        state_format._BY_KIND.pop(KIND)
        state_format._BY_TYPE.pop(Steps)


def _with_steps(*counts: float) -> fc.Linear:
    lin = fc.Linear(16, 8)
    lin._scheme_state.update({i: Steps(torch.tensor([c])) for i, c in enumerate(counts)})
    return lin


def test_a_registered_format_saves_and_loads_its_state(steps_format):
    source = _with_steps(3.0, 5.0)
    saved = source.state_dict()
    state = saved["_extra_state"]
    # The codec's header (magic, version, the format's kind, length), then the format's.
    assert state[:5].tolist() == [0xFCA570, 2, KIND, HEADER, 2]
    assert state[HEADER:].tolist() == [3.0, 5.0]
    target = fc.Linear(16, 8)
    target.load_state_dict(saved)
    assert [target._scheme_state[i].count.item() for i in (0, 1)] == [3.0, 5.0]
    assert torch.equal(target.weight, source.weight)
    assert fc.read_extra_state(state) == {"kind": "steps", "counts": [3.0, 5.0]}


def test_its_validation_refuses_before_anything_is_written(steps_format):
    model = nn.Sequential(_with_steps(1.0), nn.ReLU(), _with_steps(2.0))
    sd = {
        k: v.clone() + 1 if not k.endswith("_extra_state") else v
        for k, v in model.state_dict().items()
    }
    sd["2._extra_state"] = sd["2._extra_state"].clone()
    sd["2._extra_state"][HEADER] = -1.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'2._extra_state'.*step counts"):
        model.load_state_dict(sd)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_unregistered_kinds_and_states_are_refused():
    state = torch.tensor([0xFCA570, 2.0, KIND, HEADER] + [0.0] * (HEADER - 4) + [1.0])
    with pytest.raises(ValueError, match=f"unknown fastcast extra state kind {KIND}"):
        fc.Linear(16, 8).load_state_dict({**fc.Linear(16, 8).state_dict(), "_extra_state": state})
    with pytest.raises(ValueError, match="does not know"):
        _with_steps(1.0).state_dict()  # no format saves Steps: never dropped silently


def test_a_kind_code_belongs_to_one_format(steps_format):
    class Other(StepsFormat):
        pass

    with pytest.raises(ValueError, match=f"kind {KIND} is StepsFormat's"):
        register_state_format(Other)
    delayed = type("Clash", (StepsFormat,), {"kind": 1})
    with pytest.raises(ValueError, match="kind 1 is DelayedStateFormat's"):
        register_state_format(delayed)
