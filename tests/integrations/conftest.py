"""Fixtures of the trainer flows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerator_state() -> Iterator[None]:
    """accelerate keeps one process-wide state (the Hugging Face Trainer builds an
    Accelerator too): each test starts and ends without one."""
    try:
        from accelerate.state import AcceleratorState  # noqa: PLC0415
    except ImportError:  # those tests skip; the Lightning ones run without it
        yield
        return
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)
