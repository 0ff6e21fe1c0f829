"""The state manager's observer points, where ``fc.profiling`` and ``fc.inspect`` attach.

Invariant: nothing is replaced to be observed. Each point tests ``attached``, a list that
is empty while no observer is attached and is never rebound (``fc.autocast``'s C methods
hold the same list and take the Python methods, which have the points, while it is not
empty).
"""

from __future__ import annotations

from typing import Any


class Observer:
    """What an observer may override; the defaults observe nothing.

    - ``range_begin(name)`` / ``range_end(token)``: around a named range (autocast enter
      and exit, a quantize, a scaled GEMM, the delayed-scaling update); ``token`` is what
      ``range_begin`` returned.
    - ``plan(module, frame, plan)``: the plan an eager quantized layer call is about to
      run; returns the plan it runs.
    """

    def range_begin(self, name: str) -> Any:
        return None

    def range_end(self, token: Any) -> None:
        return None

    def plan(self, module: Any, frame: Any, plan: Any) -> Any:
        return plan


# The key of an autograd node's ``metadata`` (a public dict per node) that names the range
# its backward's observer point opens (``fc.profiling`` writes it when the layer's forward
# ends; a node without it opens ``"fastcast.Linear.backward"``).
BACKWARD_RANGE = "fastcast.range"

# The attached observers, in attach order. Mutated in place, never rebound.
attached: list[Observer] = []


def attach(observer: Observer) -> None:
    """Attach ``observer`` (a RuntimeError when it is attached already)."""
    if any(o is observer for o in attached):
        raise RuntimeError(f"fastcast: {observer!r} is attached already")
    attached.append(observer)


def detach(observer: Observer) -> None:
    """Detach ``observer`` if it is attached."""
    for i, o in enumerate(attached):
        if o is observer:
            del attached[i]
            return


def begin(name: str) -> list[tuple[Observer, Any]]:
    """Open the range ``name`` with every attached observer; ``end`` closes it."""
    return [(o, o.range_begin(name)) for o in tuple(attached)]


def end(opened: list[tuple[Observer, Any]]) -> None:
    """Close what ``begin`` opened, innermost observer first."""
    for observer, token in reversed(opened):
        observer.range_end(token)


def observe_plan(module: Any, frame: Any, plan: Any) -> Any:
    """The plan a layer call runs, as the attached observers leave it."""
    for observer in tuple(attached):
        plan = observer.plan(module, frame, plan)
    return plan
