"""``fc.Conv1D``: Hugging Face's ``Conv1D`` (GPT-2, GPT, ...) with quantized GEMMs.

transformers' ``pytorch_utils.Conv1D(nf, nx)`` is a linear layer whose weight is stored
transposed, ``[nx, nf]`` = ``[in, out]``, and whose forward is ``addmm(bias, x, weight)``.
``fc.Conv1D`` keeps that layout and those state-dict keys (so plain checkpoints and
``save_pretrained`` directories load as they are) and runs ``fc.Linear``'s GEMMs on the
transposed view of the weight: its numerics are, bit for bit, those of an ``fc.Linear``
whose weight is ``weight.t()``, in forward and both gradients, for every recipe.

Nothing here imports transformers: ``is_hf_conv1d`` recognises the class by where it is
defined, which is only possible once a model has imported it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .linear import Linear

# Where transformers defines the class (``transformers.pytorch_utils.Conv1D``).
HF_MODULE = "transformers.pytorch_utils"


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is exactly transformers' ``Conv1D`` (not a subclass, whose
    forward may differ), without importing transformers."""
    hf = sys.modules.get(HF_MODULE)
    return hf is not None and type(module) is getattr(hf, "Conv1D", None)


class Conv1D(Linear):
    """Drop-in for transformers' ``Conv1D(nf, nx)``: ``weight`` ``[nx, nf]`` (in, out),
    ``bias`` ``[nf]``, the same state-dict keys (plus ``_extra_state`` only while it keeps
    DelayedScaling state, as ``fc.Linear``), and the attributes ``nf``/``nx`` (also as
    ``out_features``/``in_features``).

    Outside ``fc.autocast`` it computes what transformers' ``Conv1D`` computes; inside,
    its GEMMs are ``fc.Linear``'s on ``weight.t()`` (everything ``fc.Linear`` documents
    applies: padding of the tokens, the micro-batch weight cache, checkpoints, recompute).

    It subclasses ``fc.Linear`` (and so ``nn.Linear``) to share that machinery; code that
    reads ``m.weight`` of any ``nn.Linear`` as ``[out, in]`` must check for it (PEFT
    treats Hugging Face's ``Conv1D`` with ``fan_in_fan_out=True``).
    """

    _fc_transposed = True

    def __init__(
        self,
        nf: int,
        nx: int,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)
        for what, n in (("nf", nf), ("nx", nx)):
            if type(n) is not int or n <= 0:
                raise ValueError(f"fastcast.Conv1D: {what} must be an int > 0, got {n!r}")
        self.nf = nf
        self.nx = nx
        self.in_features = nx
        self.out_features = nf
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        self.reset_parameters()
        self._init_runtime()

    def reset_parameters(self) -> None:
        # transformers' initialisation of Conv1D (not nn.Linear's, which reads the
        # weight's fan-in from dim 1).
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _get_name(self) -> str:
        return "fastcast.Conv1D"

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"

    def _where(self, key: str | None = None) -> str:
        features = f"nf={self.nf}, nx={self.nx}"
        name = self._fc_name
        where = f"fc.Conv1D {name!r} ({features})" if name else f"fc.Conv1D({features})"
        return where if key is None else f"{where} at {key!r}"


def adopt_hf_conv1d(module: nn.Module) -> Conv1D:
    """Turn transformers' ``Conv1D`` ``module`` into an ``fc.Conv1D``, in place (the same
    object, parameters, buffers and hooks), and return it."""
    module.__class__ = Conv1D
    # Linear reads in_features/out_features; transformers' names stay for its code.
    module.__dict__.update(in_features=module.nx, out_features=module.nf)
    module._init_runtime()  # type: ignore[operator]
    return module  # type: ignore[return-value]
