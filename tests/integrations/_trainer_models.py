"""What the trainer flows share: a tiny Llama from a config, the tokens it learns, the
recipe and the bound on the loss."""

from __future__ import annotations

import _tiny_models
import torch
from _tiny_models import VOCAB
from torch import nn

import fastcast as fc

SEQ = 16
ROWS = 8  # two batches of 4
BATCH = 4
LR = 3e-3
STEPS = 20
# The recipe of the flows: per-tensor current scaling, the one closest to FP32 here.
RECIPE = fc.Float8CurrentScaling()
# The loss compared: the mean of the last steps' (one step's loss depends on its batch).
LAST = 6
# A quantized run's loss against its FP32 run's (issue 36: within 2%).
BOUND = 0.02


def tiny_llama(seed: int = 0) -> nn.Module:
    """The flows' model: the shared tiny Llama, positions for ``SEQ`` tokens."""
    return _tiny_models.tiny_llama(positions=SEQ, seed=seed)


def token_rows() -> torch.Tensor:
    """``ROWS`` sequences of random tokens, the same on every call (the model learns them)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)


def final_loss(losses: list[float]) -> float:
    assert len(losses) == STEPS, losses
    return sum(losses[-LAST:]) / LAST


def record_recipes(model: nn.Module) -> list:
    """The recipe in force (``fc.get_autocast_recipe()``, None outside any autocast) at
    each call of the model's first converted layer, appended as it runs."""
    seen: list = []
    layer = next(m for m in model.modules() if isinstance(m, fc.Linear))
    layer.register_forward_pre_hook(lambda *_: seen.append(fc.get_autocast_recipe()))
    return seen
