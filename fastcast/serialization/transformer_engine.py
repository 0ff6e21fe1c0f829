"""What fastcast may unpickle of TransformerEngine's extra state, and how it describes it.

Used only on an unpickled payload, that is inside ``fc.allow_unsafe_extra_state()``.
``TE_ALLOW_LIST`` is what the restricted unpickler (``unpickling.py``, which knows no
library's format) may build from TransformerEngine's extra state: plain data and tensors,
and stand-ins for TransformerEngine's recipe classes, which it pickles next to the scales.
"""

from __future__ import annotations

from typing import Any

import torch

from .pickle_model import AllowList
from .unpickling import TORCH_ALLOW_LIST

TE_RECIPE_MODULE = "transformer_engine.common.recipe"
# The classes of that module a TransformerEngine recipe object is pickled with: the recipes
# themselves and the values their fields hold (the Format enum and the named tuples and
# small dataclasses of its options). CustomRecipe is not among them: its state is a
# user's callable, which the restricted unpickler refuses anyway.
_TE_RECIPE_CLASSES = (
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "MXFP4QATMXFP8BlockScaling",
    "MXFP4QATFloat8BlockScaling",
    "Format",
    "_FormatHelper",
    "_OverrideLinearPrecision",
    "QParams",
    "MMParams",
)


class _ReadOnlyClass(type):
    """A metaclass whose classes cannot be changed once made (unpickling ``BUILD`` on a
    class object sets its attributes; a stand-in must stay what it is for later loads)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"{cls.__module__}.{cls.__qualname__} cannot be changed")

    def __delattr__(cls, name: str) -> None:
        raise AttributeError(f"{cls.__module__}.{cls.__qualname__} cannot be changed")


class TEStandIn(metaclass=_ReadOnlyClass):
    """Stands in for a TransformerEngine recipe class; TransformerEngine is never imported.

    The recipe object is configuration that the conversion leaves behind (fastcast's
    recipe is whatever ``fc.autocast`` is given), so a stand-in only keeps what unpickling
    hands it: constructor arguments and state, without looking at them. It has no
    ``__dict__``, so unpickling cannot give an instance attributes (a ``__setstate__`` of
    its own choosing, say); its ``__setstate__`` just stores the state.
    """

    __slots__ = ("args", "kwargs", "state")

    def __new__(cls, *args: Any, **kwargs: Any) -> TEStandIn:
        self = object.__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # the arguments were kept by __new__

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<stand-in for {type(self).__module__}.{type(self).__qualname__}>"


TE_STAND_INS: dict[str, type] = {
    name: _ReadOnlyClass(
        name, (TEStandIn,), {"__module__": TE_RECIPE_MODULE, "__qualname__": name, "__slots__": ()}
    )
    for name in _TE_RECIPE_CLASSES
}

# What fastcast unpickles inside the opt-in: plain data, tensors and the stand-ins, which
# alone may be given a state (a dataclass recipe pickles as NEWOBJ then BUILD).
_TE_GLOBALS = {(TE_RECIPE_MODULE, name): cls for name, cls in TE_STAND_INS.items()}
TE_ALLOW_LIST: AllowList = TORCH_ALLOW_LIST.extended(
    _TE_GLOBALS,
    "plain containers, tensors and TransformerEngine's recipe classes",
    buildable=_TE_GLOBALS,
)


def hashable(key: Any) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def describe_items(state: dict[Any, Any]) -> str:
    def what(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        return type(value).__name__

    items = ", ".join(f"{k!r}: {what(v)}" for k, v in state.items())
    return f"{{{items}}}" if items else "an empty dict"
