"""User flows on a tensor-parallel converted MLP (``ColwiseParallel`` then
``RowwiseParallel``, two gloo ranks): activation checkpointing in both of
``torch.utils.checkpoint``'s modes, and DelayedScaling calibration. One spawn, shared by
the tests through a module-scoped fixture (workers: ``_tp_flow_workers.py``)."""

from __future__ import annotations

from typing import Any

import _tp_flow_workers as workers
import pytest
import torch
from _spawn import DISTRIBUTED_MARKS, share, spawn_ranks

pytestmark = DISTRIBUTED_MARKS


@pytest.fixture(scope="module")
def flows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("tp_flows")
    return share(spawn_ranks(workers.entry, "tp_flows", 2, out_dir, 240))


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("recipe", workers.FLOW_RECIPES)
def test_activation_checkpointing_changes_nothing(flows, recipe, mode):
    """The recomputed forward quantizes as the original did (delayed scaling replays its
    scales): every step's gradients, the input's included, the losses, the parameters
    and the delayed states equal the run without checkpointing, bit for bit."""
    for result in flows:
        plain, got = result[f"{recipe}.plain"], result[f"{recipe}.{mode}"]
        assert torch.equal(got["losses"], plain["losses"])
        for step, (g, p) in enumerate(zip(got["grads"], plain["grads"])):
            for name in p:
                assert torch.equal(g[name], p[name]), (step, name)
        for name, p in plain["params"].items():
            assert torch.equal(got["params"][name], p), name
        for a, b in zip(got["states"], plain["states"]):
            for key in b:
                assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("recipe", workers.FLOW_RECIPES)
def test_tensor_parallel_flows_match_one_process(flows, recipe):
    """And the tensor-parallel runs agree with one process (the row-parallel layer's
    all-reduce sums two partial GEMMs: FP32 rounding)."""
    ref = flows[0][f"{recipe}.reference"]
    for result in flows:
        got = result[f"{recipe}.non_reentrant"]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-6, atol=0)
        assert max_rel(got["params"], ref["params"]) < 1e-5


def test_calibration_under_tensor_parallelism(flows):
    """``fc.autocast(enabled=False, calibrating=True)``: the forward is the plain one, and
    the amaxes recorded (of the whole weight, over both ranks' shards) give the histories
    and scales one process records; the first FP8 step then has its loss."""
    ref = flows[0]["calibrated.reference"]
    for result in flows:
        got = result["calibrated"]
        torch.testing.assert_close(got["plain"], ref["plain"], rtol=1e-6, atol=1e-6)
        assert len(got["states"]) == len(ref["states"]) == 2
        for layer, (a, b) in enumerate(zip(got["states"], ref["states"])):
            for key in ("forward.amax_history", "forward.scale"):
                torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=0, msg=f"{layer} {key}")
            assert a["forward.amax_history"].abs().sum() > 0  # calibration recorded
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=0)


def test_calibration_without_a_group_is_refused_naming_the_layer(flows):
    for result in flows:
        msg = result["calibration_without_group"]
        assert "fc.Linear '0'" in msg and "amax_reduction_group" in msg, msg


@pytest.mark.parametrize("recipe", ["current", "mxfp8"])
def test_sequence_sharded_row_parallel_output_is_reduce_scattered(flows, recipe):
    """``RowwiseParallel(output_layouts=Shard(1))`` of a bias-free layer: the partial
    products are reduce-scattered (half the bytes of the all-reduce the replicated output
    needs), and each rank's output slice is that of the replicated output, bit for bit."""
    for rank, result in enumerate(flows):
        runs = result[f"row_output.{recipe}"]
        rep, shard = runs["replicate"], runs["shard"]
        assert rep["calls"] == {"all_reduce": 1, "reduce_scatter_single": 0}
        assert shard["calls"] == {"all_reduce": 0, "reduce_scatter_single": 1}
        half = rep["y"].shape[1] // 2
        assert torch.equal(shard["y"], rep["y"][:, rank * half : (rank + 1) * half])
