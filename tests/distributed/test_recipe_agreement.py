"""Ranks that quantize with different recipes get a clear error, not a hang
(``fastcast.distributed.agreement``): on each path whose collectives depend on the recipe,
every rank raises a RuntimeError naming each rank's recipe; ranks that agree pay one
check per process group and recipe. Two gloo ranks, one spawn (``_agreement_workers.py``)
shared by the tests."""

from __future__ import annotations

from typing import Any

import _agreement_workers as workers
import pytest
import torch
from _spawn import DISTRIBUTED_MARKS, spawn_ranks

import fastcast as fc
from fastcast.distributed import agreement as agreement_module

pytestmark = DISTRIBUTED_MARKS

# The whole spawn: four refusals and the agreeing runs take seconds; without the check
# the first case alone would block until the process group's 60 s timeout.
TIMEOUT = 180.0


@pytest.fixture(scope="module")
def agreement(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("agreement")
    return spawn_ranks(workers.entry, "agreement", 2, out_dir, TIMEOUT)


def assert_refused(results: list[dict[str, Any]], case: str) -> None:
    recipes = results[0]["recipes"]
    for rank, result in enumerate(results):
        error = result[f"{case}.error"]
        assert "use different recipes" in error, (case, rank, error)
        for other, recipe in enumerate(recipes):
            assert f"rank {other}: {recipe}" in error, (case, rank, error)


def test_fsdp2_ranks_converted_for_different_recipes(agreement):
    """``fc.convert(..., recipe=r, quantized_all_gather=True)`` with another ``r`` on each
    rank: the first quantized all-gather raises on both ranks, naming both recipes."""
    assert_refused(agreement, "fsdp_convert")


def test_fsdp2_ranks_autocast_with_different_recipes(agreement):
    """FSDP2, each rank's ``fc.autocast`` with its own recipe and the amaxes reduced over
    the world: the first forward raises on both ranks, naming both recipes."""
    assert_refused(agreement, "fsdp_autocast")


def test_tensor_parallel_ranks_with_different_recipes(agreement):
    """Tensor parallelism (ColwiseParallel then RowwiseParallel), each rank's autocast
    with its own recipe: refused on both ranks, naming both recipes."""
    assert_refused(agreement, "tp")


def test_sequence_parallel_ranks_with_different_recipes(agreement):
    """Sequence parallelism (``QuantizedColwiseParallel``: the sequence-sharded input
    gathered quantized, its layout the recipe's): refused on both ranks before the gather."""
    assert_refused(agreement, "sp")


@pytest.mark.parametrize("path", ["fsdp_convert", "fsdp_autocast", "tp"])
def test_agreeing_ranks_check_once(agreement, path):
    """Ranks on one recipe: one check (one small all-gather) on the first step, for the
    path's group and recipe, and none on the next steps, though each step's autocast
    gets a new (equal) recipe object."""
    for rank, result in enumerate(agreement):
        counts = result["agreeing"][path].tolist()
        assert counts == [1] + [0] * (workers.STEPS - 1), (path, rank, counts)


# -- in this process: the fingerprint's text, and what is never checked ----------------------


def _qfactory(role: str) -> Any:
    return None


def test_description_is_the_same_in_every_process():
    """Equal recipes give one text, and a callable field is named by module and qualified
    name (a recipe's repr names it by address, which differs between processes)."""
    custom = fc.CustomRecipe(_qfactory)
    text = agreement_module.describe(custom)
    assert text == f"CustomRecipe(qfactory=<{__name__}._qfactory>)"
    assert agreement_module.describe(fc.CustomRecipe(_qfactory)) == text
    for recipe in (fc.DelayedScaling(margin=1), fc.Float8CurrentScaling()):
        assert agreement_module.describe(recipe) == repr(recipe)


def test_recipes_that_differ_in_any_field_have_other_fingerprints():
    recipes = [
        fc.DelayedScaling(),
        fc.DelayedScaling(margin=1),
        fc.DelayedScaling(amax_compute_algo="most_recent"),
        fc.Float8CurrentScaling(),
        fc.Float8CurrentScaling(use_power_2_scales=True),
        fc.Float8RowwiseScaling(),
        fc.Float8BlockScaling(),
        fc.MXFP8BlockScaling(),
        fc.NVFP4BlockScaling(),
        fc.NVFP4BlockScaling(stochastic_rounding=False),
        fc.CustomRecipe(_qfactory),
    ]
    prints = {agreement_module._fingerprint(r, agreement_module.describe(r)) for r in recipes}
    assert len(prints) == len(recipes)


@pytest.mark.parametrize("group", [None, object(), "group"], ids=["none", "object", "str"])
def test_no_check_without_a_process_group(group):
    """None (nothing is reduced) and objects that are not process groups: no collective,
    nothing kept."""
    before = len(agreement_module.agreed_recipes)
    agreement_module.agree(fc.Float8CurrentScaling(), torch.device("cpu"), "a test", group)
    assert len(agreement_module.agreed_recipes) == before
