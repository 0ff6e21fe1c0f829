"""Checkpoint save and load of an ``fc.Linear`` model against the same ``nn.Linear`` model.

The model is ``nn.Sequential`` of 100 linear layers of width 512 (with bias, float32,
CPU: about 105 MB of parameters), built with the same seed from ``nn.Linear``
(``nn``), that model through ``fc.convert`` (``fc``: no scaling state), and the
converted model after one training step under ``fc.autocast`` with
``fc.DelayedScaling(amax_history_len=16)`` (``fc_delayed``: scales and amax histories
in every layer's extra state). Two formats are timed:

- ``torch``: ``torch.save(model.state_dict(), path)``; loading is
  ``model.load_state_dict(torch.load(path, weights_only=True, mmap=True))``;
- ``safetensors``: ``safetensors.torch.save_file(model.state_dict(), path)``; loading
  is ``model.load_state_dict(safetensors.torch.load_file(path))``.

Saving includes ``state_dict()`` (which calls ``get_extra_state``); loading includes
``load_state_dict`` into an already-built model of the same kind (which calls
``set_extra_state``). Each save entry records the file's size in
``benchmark.extra_info["bytes"]``. fastcast's per-layer extra state is a small float32
tensor (64 bytes stateless; 268 here with delayed scaling), so it costs next to nothing
in bytes; the targets ask for 1.1x of ``nn.Linear`` in each. Loading pays per entry:
the readers spend about 14 µs (safetensors) and 40 µs (``torch.load`` with mmap) per
tensor on this machine whatever its size, and a delayed-scaling state takes ~55 µs to
validate and install; against a 1 MB layer that shows, against larger layers it fades.
Files go to a temporary directory that is removed after each test, never into the
repository.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import fastcast as fc

LAYERS = 100
WIDTH = 512
KINDS = ["nn", "fc", "fc_delayed"]
FORMATS = {"torch": ".pt", "safetensors": ".safetensors"}
NAMES = {"fc": "fc.Linear", "fc_delayed": "fc.Linear (delayed state)"}

TARGETS = [
    (
        f"checkpoint-{op}-{fmt}",
        f"test_{op}_{fmt}[{kind}]",
        f"test_{op}_{fmt}[nn]",
        1.1,
        f"{NAMES[kind]} {fmt} {op} / nn.Linear",
    )
    for fmt in FORMATS
    for op in ("save", "load")
    for kind in NAMES
] + [
    (
        f"checkpoint-save-{fmt}",
        f"test_save_{fmt}[{kind}]",
        f"test_save_{fmt}[nn]",
        1.1,
        f"{NAMES[kind]} {fmt} file size / nn.Linear",
        "bytes",
    )
    for fmt in FORMATS
    for kind in NAMES
]

# Each call moves ~105 MB: a few rounds are enough, and keep the module well under a minute.
SLOW = pytest.mark.benchmark(min_rounds=5, max_time=0.3)


def build(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    if kind != "nn":  # as users convert: the model also gets the load-validating pre-hook
        fc.convert(model)
    if kind == "fc_delayed":
        with fc.autocast(recipe=fc.DelayedScaling(amax_history_len=16)):
            out = model(torch.randn(8, WIDTH))
        out.sum().backward()
        model.zero_grad()
    return model


@pytest.fixture(scope="module", params=KINDS)
def model(request) -> nn.Sequential:
    """One model per kind, shared by its tests (each load replaces its state by an equal one)."""
    return build(request.param)


@pytest.fixture
def ckpt_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fastcast-bench-") as path:
        yield Path(path)


def save_torch(model: nn.Module, path: Path) -> None:
    torch.save(model.state_dict(), path)


def load_torch(model: nn.Module, path: Path) -> None:
    model.load_state_dict(torch.load(path, weights_only=True, mmap=True))


def save_safetensors(model: nn.Module, path: Path) -> None:
    safetensors.torch.save_file(model.state_dict(), path)


def load_safetensors(model: nn.Module, path: Path) -> None:
    model.load_state_dict(safetensors.torch.load_file(path))


def _save(benchmark, fmt: str, save, model: nn.Module, ckpt_dir: Path) -> None:
    benchmark.group = f"checkpoint-save-{fmt}"
    path = ckpt_dir / f"model{FORMATS[fmt]}"
    benchmark(save, model, path)
    benchmark.extra_info["bytes"] = os.path.getsize(path)


def _load(benchmark, fmt: str, save, load, model: nn.Module, ckpt_dir: Path) -> None:
    benchmark.group = f"checkpoint-load-{fmt}"
    path = ckpt_dir / f"model{FORMATS[fmt]}"
    save(model, path)
    benchmark(load, model, path)


@SLOW
def test_save_torch(benchmark, model, ckpt_dir):
    _save(benchmark, "torch", save_torch, model, ckpt_dir)


@SLOW
def test_load_torch(benchmark, model, ckpt_dir):
    _load(benchmark, "torch", save_torch, load_torch, model, ckpt_dir)


@SLOW
def test_save_safetensors(benchmark, model, ckpt_dir):
    _save(benchmark, "safetensors", save_safetensors, model, ckpt_dir)


@SLOW
def test_load_safetensors(benchmark, model, ckpt_dir):
    _load(benchmark, "safetensors", save_safetensors, load_safetensors, model, ckpt_dir)
