"""FSDP2 x tensor parallelism on a 2x2 mesh, DCP checkpoints resharded from 2 ranks to 1
and 4, and gradient accumulation under FSDP2 (gloo, CPU; workers in ``_mesh_workers.py``).

Two spawns shared by the tests through module-scoped fixtures: ``mesh_save`` (2 ranks)
writes the checkpoints that ``mesh2d`` (4 ranks) loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _mesh_workers as workers
import pytest
import torch
from _bounds import assert_sum_rounding
from _spawn import DISTRIBUTED_MARKS, share, spawn_ranks

pytestmark = DISTRIBUTED_MARKS

HARD_TIMEOUT = 240.0  # seconds for a whole spawn; a healthy one takes well under a minute
# A compiling spawn's guard: each rank compiles its graphs itself, and from an empty Inductor
# cache on two busy cores that alone took over 240 s.
COMPILE_TIMEOUT = 600.0


def spawn(
    section: str, world: int, out_dir: Path, env: dict[str, str], timeout: float = HARD_TIMEOUT
) -> list[dict[str, Any]]:
    """Run ``section`` on ``world`` spawned ranks (``env`` added to their environment);
    their results, by rank. A rank still running after ``timeout`` seconds is killed."""
    return spawn_ranks(workers.entry, section, world, out_dir, timeout, env)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mesh_ckpt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, checkpoints: Path) -> list[dict[str, Any]]:
    env = {"FASTCAST_MESH_CKPT": str(checkpoints)}
    return spawn("mesh_save", 2, tmp_path_factory.mktemp("mesh_save"), env)


@pytest.fixture(scope="module")
def mesh2d(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: Path, saved: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    env = {"FASTCAST_MESH_CKPT": str(checkpoints)}
    return share(spawn("mesh2d", 4, tmp_path_factory.mktemp("mesh2d"), env))


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


def states_equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) > 0 and all(
        sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        for sa, sb in zip(a, b)
    )


# -- 1. FSDP2 x TP on a (dp=2, tp=2) mesh --------------------------------------------------------

DP, TP = workers.DP, workers.TP
HIDDEN_SHARD = 256 // TP


@pytest.mark.slow  # four ranks (the mesh2d spawn): make test-slow
@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_fsdp2_x_tp_matches_single_process(mesh2d, recipe):
    """``parallelize_module`` over the "tp" sub-mesh, ``fully_shard`` over "dp" (FSDP2
    gathers each weight in high precision into the TP-sharded DTensor the layer runs
    on), 3 SGD steps, against one process (``workers.MICRO_REFERENCE`` says which
    recipes' reference runs each data-parallel rank's rows as a micro-batch).

    Bit for bit: the first layer's output (each rank's rows and columns). Within FP32
    rounding (the row-parallel all-reduce, FSDP2's reduce-scatter and the per-rank loss
    sums add in another order than one process): losses, first-step gradients and the
    parameters after 3 steps."""
    ref = mesh2d[0][f"{recipe}.reference"]
    measured = []  # printed (pytest -s): the figures docs/distributed.md quotes
    for rank, result in enumerate(mesh2d):
        res = result[recipe]
        d, t = divmod(rank, TP)
        assert res["weight_meshes"] == [["dp", "tp"]] * 2
        cols = slice(t * HIDDEN_SHARD, (t + 1) * HIDDEN_SHARD)
        assert torch.equal(res["first_layer"], ref["first_layer"][d][..., cols]), rank
        # FSDP2 averages over the data-parallel ranks: each gradient is half the sum.
        grads = {n: g * DP for n, g in res["grads"].items()}
        measured.append((max_rel(grads, ref["grads"]), max_rel(res["params"], ref["params"])))
        assert measured[-1][0] < 1e-5 and measured[-1][1] < 1e-5, (rank, measured[-1])
        for name, p in res["params"].items():  # all ranks hold one model
            assert torch.equal(p, mesh2d[0][recipe]["params"][name]), (rank, name)
    # The tensor-parallel ranks of one data-parallel rank share its loss; those of the
    # data-parallel ranks add up to the single process's.
    for d in range(DP):
        assert torch.equal(mesh2d[d * TP][recipe]["losses"], mesh2d[d * TP + 1][recipe]["losses"])
    losses = sum(mesh2d[d * TP][recipe]["losses"] for d in range(DP))
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-6, atol=0)
    assert losses[-1] < losses[0]
    loss_rel = ((losses - ref["losses"]).abs() / ref["losses"]).max().item()
    worst = [max(m[i] for m in measured) for i in (0, 1)]
    print(f"\n2-D {recipe}: losses {loss_rel:.1e}, grads {worst[0]:.1e}, params {worst[1]:.1e}")
    if recipe == "delayed":
        for result in mesh2d:
            assert states_equal(result[recipe]["states"], mesh2d[0][recipe]["states"])
        # The first layer's forward amaxes (inputs reduced over all 4 ranks, weight
        # shards over "tp") are the single process's, bit for bit.
        got, want = mesh2d[0][recipe]["states"][0], ref["states"][0]
        assert torch.equal(got["forward.amax_history"], want["forward.amax_history"])


@pytest.mark.slow  # four ranks (the mesh2d spawn)
def test_fsdp2_x_tp_refusals(mesh2d):
    """``quantized_all_gather=True`` on a 2-D model, and a layer called with FSDP2's
    ungathered 2-D weight: ``NotImplementedError``s naming the layer and what to do."""
    for result in mesh2d:
        msg = result["quantized_gather_error"]
        assert msg.startswith("fc.Linear '0'") and "quantized_all_gather=False" in msg, msg
        msg = result["ungathered_error"]
        assert msg.startswith("fc.Linear '0'") and "1-D mesh, got a 2-D one" in msg, msg


# -- 2. DCP: saved on 2 ranks, loaded on 1 and on 4 -------------------------------------------


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_dcp_saved_on_2_loaded_on_1(saved, kind, recipe):
    """One process (``no_dist=True``) loads the whole tensors and the delayed states; its
    forward equals the FSDP2 model's bit for bit (FSDP2 runs whole GEMMs) and the
    tensor-parallel one's within FP32 rounding (one GEMM instead of two partial ones)."""
    r = saved[0][f"{kind}.{recipe}"]
    for name, p in r["params"].items():
        assert torch.equal(r["single_params"][name], p), name
    if recipe == "delayed":
        assert states_equal(r["single_states"], r["states"])
    if kind == "fsdp":
        assert torch.equal(r["single"], r["forward"])
    else:
        torch.testing.assert_close(r["single"], r["forward"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # four ranks (the mesh2d spawn)
@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_dcp_saved_on_2_loaded_on_4(saved, mesh2d, kind, recipe):
    """4 ranks load the 2-rank checkpoint into a fresh model sharded 4 ways: the same
    parameters and delayed states; the same forward, bit for bit under FSDP2, within
    FP32 rounding under tensor parallelism (4 partial GEMMs summed instead of 2)."""
    ref = saved[0][f"{kind}.{recipe}"]
    for result in mesh2d:
        r = result[f"load.{kind}.{recipe}"]
        assert r["local_rows"] == workers.DCP_HIDDEN // 4  # sharded 4 ways
        for name, p in ref["params"].items():
            assert torch.equal(r["params"][name], p), name
        if recipe == "delayed":
            assert states_equal(r["states"], ref["states"])
        if kind == "fsdp":
            assert torch.equal(r["forward"], ref["forward"])
        else:
            torch.testing.assert_close(r["forward"], ref["forward"], rtol=1e-5, atol=1e-6)
            if result is mesh2d[0]:  # (pytest -s prints it)
                diff = ((r["forward"] - ref["forward"]).norm() / ref["forward"].norm()).item()
                print(f"\nTP 2 -> 4 ranks, {recipe}: forward differs by {diff:.1e} (relative)")


# -- 3. gradient accumulation under FSDP2 -------------------------------------------------------


@pytest.mark.parametrize("recipe", workers.ACC_RECIPES)
def test_fsdp2_gradient_accumulation_keeps_the_quantized_weight(saved, recipe):
    """FSDP2 keeping the weights gathered (``reshard_after_forward=False``,
    ``set_reshard_after_backward(False)`` until the last micro-batch), 2 micro-batches
    per step: the second (``is_first_microbatch=False``) takes the weights quantized in
    the first, and the run equals one process on the same micro-batches (same flags)
    within FP32 rounding. Current scaling and MXFP8 quantize an unchanged weight to the
    same codes, so there the run also equals the run without the flags, bit for bit;
    delayed scaling's kept weight has the first micro-batch's scale (the history moves
    after each micro-batch), as in one process."""
    ref = saved[0][f"acc.{recipe}.reference"]
    for rank, result in enumerate(saved):
        run, plain = result[f"acc.{recipe}"], result[f"acc.{recipe}.no_flags"]
        assert run["kept"] == [True] * workers.STEPS
        assert plain["kept"] == [False] * workers.STEPS
        if recipe != "delayed":
            assert torch.equal(run["losses"], plain["losses"])
            for name, p in plain["params"].items():
                assert torch.equal(run["params"][name], p), name
        assert max_rel(run["params"], ref["params"]) < 1e-5, rank
    losses = sum(result[f"acc.{recipe}"]["losses"] for result in saved)
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", workers.ACC_RECIPES)
def test_fsdp2_kept_weight_dropped_when_the_weight_changes(saved, recipe):
    """The sharded weight changed in place (no optimizer step) and gathered again: the
    next micro-batch with ``is_first_microbatch=False`` quantizes the new weight, as one
    process (whose version counter moves) does."""
    runs = [r[f"changed.{recipe}"] for r in saved] + [saved[0][f"changed.{recipe}.reference"]]
    for run in runs:
        for after, fresh in zip(run["after_change"], run["after_change_fresh"]):
            assert torch.equal(after, fresh)
    for a, b in zip(runs[0]["after_change"], runs[-1]["after_change"]):
        assert torch.equal(a, b)
    # The case a test of the weight's version and address alone misses: FSDP2 gathered
    # the new values into the memory of the old ones (on some rank, in some round).
    assert any(any(r["same_address"]) for r in runs[:-1]), [r["same_address"] for r in runs]


# -- 4. torch.compile of an FSDP2 model under fc.autocast -------------------------------------


@pytest.fixture(scope="module")
def mesh_compile(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn("mesh_compile", 2, tmp_path_factory.mktemp("mesh_compile"), {}, COMPILE_TIMEOUT)


@pytest.mark.compile
@pytest.mark.slow  # 46 s: two ranks compiling
def test_compiled_fsdp2_delayed_scaling(mesh_compile):
    """``torch.compile`` of an FSDP2 model, DelayedScaling over the world group: with
    FSDP2's high-precision gather and with the quantized (FP8) gather, the eager outputs
    and gradients within FP32 rounding. (With the group, Dynamo runs the layers'
    quantization in eager; the GEMMs take the gathered FP8 weight as eager's do.)

    Not bit for bit: eager adds the last layer's bias after its GEMM, the compiled graph
    in it (``addmm``: MKL's kernel for this CPU orders the adds), and the bias gradient
    is ATen's cascade sum in eager, Inductor's loop compiled. Bound (``_bounds``): an
    output is a sum of 256 products and the bias, a bias gradient one of 2 x 128 tokens'
    gradients: 2 * 256 * U (3.1e-5) relative; measured 5e-8 on an AVX2 EPYC."""
    terms = workers.base.TP_HIDDEN + 1
    for result in mesh_compile:
        for kind in ("hp", "fp8"):
            eager, compiled = result[f"{kind}.eager"], result[f"{kind}.compiled"]
            assert eager["error"] == compiled["error"] == "", kind
            assert len(compiled["outs"]) == len(eager["outs"]) == 2
            for step, (a, b) in enumerate(zip(compiled["outs"], eager["outs"], strict=True)):
                assert_sum_rounding(a, b, terms, (kind, step))
            for step, (ga, gb) in enumerate(zip(compiled["grads"], eager["grads"], strict=True)):
                for i, (a, b) in enumerate(zip(ga, gb, strict=True)):
                    assert_sum_rounding(a, b, terms, (kind, step, i))
        assert all(r["autocast_closed"] for r in result.values())
