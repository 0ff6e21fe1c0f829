"""fastcast over torch.distributed: two CPU ranks, gloo backend.

Sections of two ranks each (see ``_dist_workers.py``), each read by the tests of this
file through a module-scoped fixture of its name; all but the compiling one run in one
spawn (``two_ranks``: starting two interpreters that import torch costs seconds, so the
sections the selected tests use run one after the other in the same two processes):

- ``registry``: DelayedScaling with ``amax_reduction_group`` and no wrapper: identical
  scales on ranks that see different data, one ``all_reduce`` per key and direction per
  step, and no deadlock when a rank skips a module;
- ``ddp``: DistributedDataParallel against a single process on the concatenated batch,
  for DelayedScaling and Float8CurrentScaling;
- ``fsdp2``: ``fully_shard`` on a CPU device mesh, the same comparison;
- ``tp``, ``tp_dcp``: tensor (and sequence) parallelism, and its DCP checkpoints;
- ``fsdp_fp8``, ``fsdp_qag``: FSDP2's quantized all-gather, per-tensor and block-scaled
  recipes (``fsdp_fp8_compile``, its compiled run, spawns on its own: slow);
- ``tp_llama``, ``fsdp_fp8_models``, ``fsdp_qag_models``: the longer runs (tiny Hugging
  Face Llamas, no-reshard and checkpointed variants, BF16 parameters), marked slow: the
  shared spawn runs them only under ``make test-slow``.

A worker stuck in a collective raises after the process group's timeout; a worker that
still has not exited after ``HARD_TIMEOUT`` is killed and the test fails, so a deadlock
never hangs the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _dist_workers as workers
import pytest
import torch
from _bounds import U, rel_diff, sum_orders_bound
from _spawn import DISTRIBUTED_MARKS, share, spawn_ranks

pytestmark = DISTRIBUTED_MARKS

WORLD = 2
HARD_TIMEOUT = 120.0  # seconds per section; a healthy one takes a few


def spawn(section: str, out_dir: Path) -> list[dict[str, Any]]:
    """Run ``section`` on ``WORLD`` spawned ranks; their results, by rank."""
    return spawn_ranks(workers.entry, section, WORLD, out_dir, HARD_TIMEOUT)


# The sections whose fixtures (of the same names) share one spawn, ``two_ranks``.
SHARED_SECTIONS = (
    "registry",
    "ddp",
    "fsdp2",
    "tp",
    "tp_dcp",
    "fsdp_fp8",
    "fsdp_qag",
    # The longer runs on tiny Hugging Face models and variants: make test-slow.
    "tp_llama",
    "fsdp_fp8_models",
    "fsdp_qag_models",
)


@pytest.fixture(scope="module")
def two_ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict[str, Any]]]:
    """One spawn for the shared sections that the selected tests use (``-k`` runs only
    what its tests need), one after the other (``workers.section_shared``): section ->
    results by rank."""
    used = {
        name
        for item in request.session.items
        if item.get_closest_marker("skip") is None  # conftest skips slow ones: no spawn
        for name in getattr(item, "fixturenames", ())
    }
    names = [name for name in SHARED_SECTIONS if name in used]
    results = spawn_ranks(
        workers.entry,
        "shared",
        WORLD,
        tmp_path_factory.mktemp("two_ranks"),
        HARD_TIMEOUT * len(names),
        env={"FASTCAST_TEST_SECTIONS": ",".join(names)},
    )
    return {name: [r[name] for r in results] for name in names}


def section(two_ranks: dict[str, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    """One shared section's results, by rank; its tests fail with its tracebacks if it
    raised on any rank."""
    results = two_ranks[name]
    errors = [(rank, r.get(workers.SECTION_ERROR)) for rank, r in enumerate(results)]
    shown = "".join(f"\n--- rank {rank} ---\n{text}" for rank, text in errors if text)
    if shown:
        pytest.fail(f"section {name} raised:{shown}")
    return results


@pytest.fixture(scope="module")
def registry(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return section(two_ranks, "registry")


@pytest.fixture(scope="module")
def ddp(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return section(two_ranks, "ddp")


@pytest.fixture(scope="module")
def fsdp2(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return section(two_ranks, "fsdp2")


def assert_states_equal(a: list[dict], b: list[dict], **tol: float) -> None:
    """Per-layer delayed-scaling states equal (exactly, unless tolerances are given)."""
    assert len(a) == len(b) > 0
    for layer, (sa, sb) in enumerate(zip(a, b)):
        assert sa.keys() == sb.keys()
        for key in sa:
            if tol:
                torch.testing.assert_close(sa[key], sb[key], **tol, msg=f"layer {layer} {key}")
            else:
                assert torch.equal(sa[key], sb[key]), f"layer {layer} {key}: {sa[key]} {sb[key]}"


def update_error(params: dict, ref_params: dict, init: dict) -> float:
    """Largest relative error of the total weight update over the parameters."""
    worst = 0.0
    for name, ref in ref_params.items():
        delta_ref = ref - init[name]
        delta = params[name] - init[name]
        worst = max(worst, ((delta - delta_ref).norm() / delta_ref.norm()).item())
    return worst


# -- 1. identical scales from different data ------------------------------------------------


def test_delayed_scales_identical_across_ranks(registry):
    r0, r1 = (r["delayed"] for r in registry)
    for step, (s0, s1) in enumerate(zip(r0, r1)):
        # The ranks really saw different data (rank 1's rows are 4x larger) ...
        assert s1["local_input_amax"] > 2 * s0["local_input_amax"]
        # ... and still hold the same histories and scales after every step.
        assert_states_equal(s0["states"], s1["states"])
        # The newest history row (the update rolls it to the end) of the first layer's
        # input is the max over the ranks' amaxes, and the scale comes from the window.
        fwd = s0["states"][0]["forward.amax_history"]
        expected = torch.maximum(s0["local_input_amax"], s1["local_input_amax"])
        assert fwd[-1, 0] == expected, step
        scale = s0["states"][0]["forward.scale"][0]
        torch.testing.assert_close(scale, 448.0 / fwd[:, 0].max())


# -- 5. one all_reduce per key and direction per step -----------------------------------------


def test_one_all_reduce_per_key_and_direction_per_step(registry):
    n_layers = 4
    for rank, result in enumerate(registry):
        for step, s in enumerate(result["delayed"]):
            calls = s["calls"]  # rows: (numel, is MAX)
            # The forward slab (input and weight of all 4 layers: 8 amaxes) reduces once,
            # on exiting the autocast; the backward slab (4 grad amaxes) once, after the
            # last backward. Not 2 per module.
            assert s["calls_after_forward"] == 1, (rank, step)
            assert calls.tolist() == [[2 * n_layers, 1], [n_layers, 1]], (rank, step)
        # For contrast, current scaling reduces each input and gradient amax on its own.
        assert result["current_calls"].tolist() == [[1, 1]] * (2 * n_layers)


def test_unrelated_autocast_touches_grouped_slabs(registry):
    """One step under DelayedScaling over the group, then a forward and backward of
    another model under ``Float8CurrentScaling()`` and under ``DelayedScaling()``, both
    without any group. Neither may communicate nor change the grouped key's state: if
    only one rank runs such a step (an evaluation or auxiliary model on rank 0), its
    lone all_reduce pairs with whatever the other rank does next, or hangs."""
    for result in registry:
        r = result["unrelated"]
        for name in ("current", "delayed"):
            assert r[f"{name}.calls"].tolist() == [], name
            assert_states_equal(r[f"{name}.after"], r["before"])


# -- 4. a rank skips a module ---------------------------------------------------------------


@pytest.mark.parametrize("variant", ["skip_same_key", "skip_own_key"])
def test_rank_skipping_a_module_does_not_deadlock(registry, variant):
    """Rank 1 leaves branch ``b`` out in the third step, after every module ran twice.

    ``skip_same_key``: ``a`` and ``b`` share one key, so one slab per direction; rank 1
    still updates (and reduces) it, with ``b``'s columns at amax 0. ``skip_own_key``:
    ``b`` runs under a nested autocast of another recipe, so on rank 1 a whole slab got
    no amax this step; the registry updates every slab that has a reduction group every
    step, recorded or not, so rank 1 joins that slab's all_reduce too and nobody waits.

    In both cases the skipped module contributes amax 0 on rank 1 for that step, and the
    max over the ranks is rank 0's amax: the ranks keep identical histories and scales.
    """
    r0, r1 = (r[variant] for r in registry)  # reaching here means both ranks finished
    assert [s["skipped"] for s in r1] == [False, False, True, False]
    for step, (s0, s1) in enumerate(zip(r0, r1)):
        assert s0["n_calls"] == s1["n_calls"], step  # same collectives on both ranks
        for name in ("a", "b"):
            assert_states_equal([s0[name]], [s1[name]])
        newest_b_input = s0["b"]["forward.amax_history"][-1, 0]
        if step == 2:
            # Rank 0's amax, although rank 1's input (4x larger) would have won: rank 1
            # contributed 0 for the module it skipped.
            assert s1["b_input_amax"] > s0["b_input_amax"]
            assert newest_b_input == s0["b_input_amax"]
            assert s0["b"]["backward.amax_history"][-1, 0] > 0
        else:
            assert newest_b_input == max(s0["b_input_amax"], s1["b_input_amax"])
    expected_calls = 2 if variant == "skip_same_key" else 4
    assert [s["n_calls"] for s in r0] == [expected_calls] * 4


# -- 2. DDP equals one process on the whole batch ---------------------------------------------

# Why these runs can agree closely: every rank quantizes with scales made from the max
# over ranks of its amaxes, which is the amax a single process sees on the concatenated
# batch (inputs: same rows; weights: the same on every rank; gradients: ``loss_fn``
# divides by the global row count, so each row's gradient is the single process's). With
# identical scales, each row is quantized to the same FP8 values in both runs. What is
# left is FP32 accumulation order (the wgrad GEMM over 64 rows vs. two GEMMs over 32
# rows summed by the all_reduce) and its knock-on effects: tiny differences that can
# flip an occasional FP8 rounding in later steps. UPDATE_RTOL bounds the relative error
# of the total weight update; the control runs without amax reduction (each rank
# quantizes with its own amaxes) miss it by far, which shows the bound is tight enough
# to see whether the reduction happened (measured: ~2e-7 with it, ~0.2 without).
UPDATE_RTOL = 1e-3
SCALE_RTOL = 1e-5


def check_against_reference(results: list[dict], ref: dict, recipe: str) -> None:
    """Distributed runs (one result per rank) against the single-process ``ref``."""
    for rank, res in enumerate(results):
        for name, p in res["params"].items():  # the replicas stay identical
            assert torch.equal(p, results[0]["params"][name]), (rank, name)
        err = update_error(res["params"], ref["params"], ref["init"])
        assert err < UPDATE_RTOL, (rank, err)
    # Each rank's loss covers its rows over the global count: they add up to the global.
    losses = sum(res["losses"] for res in results)
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-4, atol=0)
    assert losses[-1] < losses[0]
    if recipe == "delayed":
        assert_states_equal(results[0]["states"], results[1]["states"])
        assert_states_equal(results[0]["states"], ref["states"], rtol=SCALE_RTOL, atol=0)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_ddp_matches_single_process(ddp, recipe):
    ref = ddp[0]["reference"][recipe]
    check_against_reference([r[f"{recipe}.reduced"] for r in ddp], ref, recipe)
    # Control: without amax reduction the update differs by much more than the bound.
    err_local = update_error(ddp[0][f"{recipe}.local"]["params"], ref["params"], ref["init"])
    assert err_local > 10 * UPDATE_RTOL, err_local


# -- 3. FSDP2 -------------------------------------------------------------------------------


def test_fsdp2_shards_the_fc_linears(fsdp2):
    # fully_shard on a CPU mesh of 2 (gloo): each weight is split along dim 0.
    for result in fsdp2:
        assert result["sharded_shape"].tolist() == [[32, 64], [32, 64], [16, 64]]


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fsdp2_matches_single_process(fsdp2, recipe):
    """``fully_shard`` on each fc.Linear and the root: it trains, and matches one process
    on the whole batch as DDP does (FSDP2 averages gradients over ranks too), and the
    ranks' delayed-scaling states are identical."""
    check_against_reference([r[recipe] for r in fsdp2], fsdp2[0]["reference"][recipe], recipe)


def test_fsdp2_inplace_op_after_fc_linear(fsdp2):
    for result in fsdp2:
        assert result["inplace"]["error"] == ""
        assert result["inplace"]["view_warnings"] == []


# -- 4. tensor parallelism (parallelize_module) ----------------------------------------------


@pytest.fixture(scope="module")
def tp(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return share(section(two_ranks, "tp"))


# Recipes whose every scale is the one a single process computes (amaxes reduced over the
# tensor-parallel group where a scale spans the shards; blocks on shard boundaries).
TP_EXACT = ["delayed", "current", "rowwise", "rowwise_gw_hp", "block", "mxfp8", "nvfp4"]
TP_HIDDEN_SHARD = 128  # the MLP's hidden width 256 over two ranks


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


@pytest.mark.parametrize("recipe", TP_EXACT)
def test_tensor_parallel_matches_single_process(tp, recipe):
    """ColwiseParallel then RowwiseParallel on a converted MLP, two ranks, 3 SGD steps,
    against the same MLP in one process.

    Bit for bit: the column-parallel layer's forward (each rank's output columns) and its
    weight and bias gradients, and the delayed-scaling histories and scales. The
    row-parallel layer sums two partial GEMMs with an all-reduce where one process runs
    one GEMM, so what follows it agrees within FP32 rounding (measured <= 1e-7 relative;
    the bound leaves room for an occasional FP8 code flipped by that rounding)."""
    ref = tp[0][f"{recipe}.reference"]
    for rank, result in enumerate(tp):
        res = result[recipe]
        cols = slice(rank * TP_HIDDEN_SHARD, (rank + 1) * TP_HIDDEN_SHARD)
        assert torch.equal(res["first_layer"], ref["first_layer"][..., cols]), rank
        for name in ("0.weight", "0.bias"):
            assert torch.equal(res["grads"][name], ref["grads"][name]), (rank, name)
        assert max_rel(res["grads"], ref["grads"]) < 1e-5
        torch.testing.assert_close(res["losses"], ref["losses"], rtol=1e-6, atol=0)
        assert max_rel(res["params"], ref["params"]) < 1e-5
        for name, p in res["params"].items():  # the ranks hold one model
            assert torch.equal(p, tp[0][recipe]["params"][name]), (rank, name)
    if recipe == "delayed":
        # The first layer's forward amaxes (input, weight shards) are the single
        # process's; gradient amaxes follow the row-parallel layer's FP32 rounding.
        for result in tp:
            assert_states_equal(result[recipe]["states"], tp[0][recipe]["states"])
            assert_states_equal(result[recipe]["states"], ref["states"], rtol=1e-6, atol=0)
            got, want = result[recipe]["states"][0], ref["states"][0]
            assert torch.equal(got["forward.amax_history"], want["forward.amax_history"])


def test_tensor_parallel_current_scaling_without_group(tp):
    """Without an amax_reduction_group the layers reduce over the tensor-parallel group
    themselves: the same run as with the world group."""
    for result in tp:
        assert torch.equal(result["current.no_group"]["losses"], result["current"]["losses"])
        for name, p in result["current.no_group"]["params"].items():
            assert torch.equal(p, result["current"]["params"][name]), name


def test_tensor_parallel_refusals(tp):
    errors = tp[0]["errors"]
    assert "DelayedScaling on a tensor-parallel layer needs" in errors["delayed_without_group"]
    assert "fc.Linear '0'" in errors["delayed_without_group"]
    msg = errors["block_misaligned"]
    assert "blocks of 128" in msg and "96 output features" in msg


# -- 5. DCP: a tensor-parallel model saved on two ranks, loaded on two and on one ---------------


@pytest.fixture(scope="module")
def tp_dcp(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return section(two_ranks, "tp_dcp")


@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8"])
def test_tensor_parallel_dcp_resharded(tp_dcp, recipe):
    """Saved after 2 steps: a fresh tensor-parallel model loaded from it gives the same
    forward bit for bit; one process (no process group) loads the sharded weights whole,
    with the delayed-scaling histories and scales, and gives the same forward within the
    row-parallel layer's FP32 rounding (one GEMM instead of two partial ones)."""
    for result in tp_dcp:
        r = result[recipe]
        assert torch.equal(r["tp_loaded"], r["saved"])
    r = tp_dcp[0][recipe]
    for name, p in r["saved_params"].items():
        assert torch.equal(r["single_params"][name], p), name
    assert_states_equal(r["single_states"], r["saved_states"]) if recipe == "delayed" else None
    torch.testing.assert_close(r["single"], r["saved"], rtol=1e-5, atol=1e-6)


def flipped_lines(got: torch.Tensor, want: torch.Tensor, bound: float) -> tuple[int, float]:
    """The rows (or the columns, whichever are fewer) of ``got`` that differ from ``want``
    by more than ``bound`` of ``want``'s norm, and the relative difference of the rest.

    One quantized code that FP32 rounding moved across a rounding midpoint changes one
    row of an operand of one GEMM, so one row (an output feature's gradient, an embedded
    token's) or one column (an input feature's) of a weight gradient."""
    if got.dim() != 2:
        return 0, rel_diff(got, want)
    limit = bound * want.norm()
    counts = []
    for dim in (1, 0):
        bad = (got - want).norm(dim=dim) > limit
        keep = ~bad.unsqueeze(dim)
        rest = rel_diff(got * keep, want * keep) if keep.any() else float("inf")
        counts.append((int(bad.sum()), rest))
    return min(counts)


@pytest.fixture(scope="module")
def tp_llama(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return share(section(two_ranks, "tp_llama"))


@pytest.mark.slow  # a Hugging Face Llama per recipe, and its one-process references
@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8", "nvfp4"])
def test_tensor_parallel_hugging_face_llama(tp_llama, recipe):
    """A tiny Llama (transformers, from a config), its projections split by
    parallelize_module, trains 3 steps as one process does, compared step by step from
    the same parameters (the reference starts each step from the ranks' parameters: see
    ``workers.llama_training``).

    The row-parallel o_proj and down_proj add two partial GEMMs where one process runs
    one, and the column-parallel layers' input gradients likewise: sums of up to 256
    terms in another order, so within ``sum_orders_bound(256)`` (3e-5; measured 6e-7).
    A quantizer is a step function: now and then that rounding moves one element across
    a rounding midpoint (an NVFP4 code of gate_proj's output gradient under
    ATEN_CPU_CAPABILITY=default on an AVX2 EPYC: one row of its weight gradient off by 5%,
    the rest within 4e-7). A gradient may hold one such line per step; a scale not
    reduced over the ranks, or a shard in the wrong place, changes nearly every line.
    A parameter after a step, ``p - lr * g`` from the same parameters, differs by ``lr``
    times the gradients' difference and at most one rounding of the update on each side."""
    bound = sum_orders_bound(workers.LLAMA_INTERMEDIATE)  # the MLP's 256-term sums
    for result in tp_llama:
        res = result[f"llama.{recipe}"]
        ref = tp_llama[0][f"llama.{recipe}.reference"]
        torch.testing.assert_close(res["losses"], ref["losses"], rtol=bound, atol=0)
        for step in range(workers.TP_STEPS):
            for name, g in res["grads"][step].items():
                want = ref["grads"][step][name]
                lines, rest = flipped_lines(g, want, bound)
                assert lines <= 1 and rest <= bound, (recipe, step, name, lines, rest)
                p, p_ref = res["params"][step][name], ref["params"][step][name]
                slack = workers.LLAMA_LR * (g - want).norm() + 2 * U * p.norm()
                assert (p - p_ref).norm() <= slack, (recipe, step, name)
        for name, p in res["params"][-1].items():  # the ranks hold one model
            assert torch.equal(p, tp_llama[0][f"llama.{recipe}"]["params"][-1][name]), name
    assert any("q_proj" in n for n in ref["params"][-1])


@pytest.mark.parametrize("recipe", ["current", "mxfp8"])
def test_sequence_parallel_matches_single_process(tp, recipe):
    """Sequence-sharded input to the colwise layer and sequence-sharded output of the
    rowwise one: the per-rank losses add up to the single process's, and the parameters
    after 3 steps agree within FP32 rounding. (torch's ColwiseParallel all-gathers the
    input in high precision; test_sequence_parallel.py has the FP8 gather.)"""
    ref = tp[0][f"{recipe}.reference"]
    losses = sum(result[f"sp.{recipe}"]["losses"] for result in tp)
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-5, atol=0)
    for result in tp:
        assert max_rel(result[f"sp.{recipe}"]["params"], ref["params"]) < 1e-5


# -- 8. FSDP2 with the quantized (FP8) all-gather ----------------------------------------------


@pytest.fixture(scope="module")
def fsdp_fp8(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return section(two_ranks, "fsdp_fp8")


FP8AG_RECIPES = ["delayed", "current"]


@pytest.mark.parametrize("recipe", FP8AG_RECIPES)
def test_fsdp_fp8_all_gather_is_used(fsdp_fp8, recipe):
    for result in fsdp_fp8:
        assert result[recipe]["fp8"]["weight_types"] == ["FSDPFloat8Weight"] * 3
        assert result[recipe]["hp"]["weight_types"] == ["Tensor"] * 3
        # Every forward GEMM under autocast took its gathered FP8 weight as it is (3 layers,
        # 20 steps); evaluation outside autocast did not.
        assert result[recipe]["fp8"]["direct"] == 3 * workers.LEAK_STEPS
        assert result[recipe]["hp"]["direct"] == 0


@pytest.mark.parametrize("recipe", FP8AG_RECIPES)
def test_fsdp_fp8_all_gather_matches_high_precision_gather_bit_for_bit(fsdp_fp8, recipe):
    # Gathering the FP8 codes and scale gives every rank what quantizing the gathered
    # high-precision weight gives: the same outputs, losses, gradients and parameters.
    for result in fsdp_fp8:
        fp8, hp = result[recipe]["fp8"], result[recipe]["hp"]
        assert torch.equal(fp8["out0"], hp["out0"])
        assert torch.equal(fp8["losses"], hp["losses"])
        for step, (g8, gh) in enumerate(zip(fp8["grads"], hp["grads"])):
            for name in gh:
                assert torch.equal(g8[name], gh[name]), (step, name)
        for name in hp["params"]:
            assert torch.equal(fp8["params"][name], hp["params"][name]), name


@pytest.mark.parametrize("recipe", FP8AG_RECIPES)
def test_fsdp_fp8_all_gather_matches_single_process(fsdp_fp8, recipe):
    ref = fsdp_fp8[0][recipe]["reference"]
    runs = [r[recipe]["fp8"] for r in fsdp_fp8]
    # First forward: each rank's rows are the single process's rows, bit for bit (same
    # weight scale and codes, input amax reduced over the ranks).
    for rank, run in enumerate(runs):
        rows = ref["out0"][rank * workers.LOCAL_BATCH : (rank + 1) * workers.LOCAL_BATCH]
        assert torch.equal(run["out0"], rows), rank
    # Losses, gradients, parameters: the ranks' partial sums and FSDP2's reduce-scatter
    # add in another order than one GEMM over the whole batch: FP32 rounding.
    losses = sum(run["losses"] for run in runs)
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-6, atol=0)
    for step, (grads, ref_grads) in enumerate(zip(runs[0]["grads"], ref["grads"])):
        for name, g in ref_grads.items():
            # FSDP2 averages the ranks' gradients; each rank's is its share of the sum.
            torch.testing.assert_close(
                grads[name] * WORLD, g, rtol=1e-5, atol=1e-7, msg=f"step {step} {name}"
            )
    for name, p in ref["params"].items():
        torch.testing.assert_close(runs[0]["params"][name], p, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("recipe", FP8AG_RECIPES)
def test_fsdp_fp8_all_gather_bytes(fsdp_fp8, recipe):
    for result in fsdp_fp8:
        fp8, hp = result[recipe]["fp8"]["bytes"], result[recipe]["hp"]["bytes"]
        # The forward gathers of one step (the biases still go in FP32) ...
        assert fp8["forward"] <= 0.27 * hp["forward"], (fp8, hp)
        # ... and backward's re-gather (reshard_after_forward) is FP8 as well.
        assert fp8["backward"] <= 0.27 * hp["backward"], (fp8, hp)
        # Weights alone: 1 byte per element against 4.
        params = result[recipe]["hp"]["params"]
        weights = sum(p.numel() for n, p in params.items() if "weight" in n)
        biases = sum(p.numel() for n, p in params.items() if "bias" in n)
        assert hp["forward"] == 4 * (weights + biases) // WORLD
        assert fp8["forward"] == (weights + 4 * biases) // WORLD


@pytest.mark.parametrize("recipe", FP8AG_RECIPES)
def test_fsdp_fp8_all_gather_no_leak(fsdp_fp8, recipe):
    # After steps 10 and 20: the same number of live tensors and bytes of live storage as
    # after step 1 (each the least of two samples, see _live_storage).
    for result in fsdp_fp8:
        for name, run in result[recipe].items():
            if isinstance(run, dict) and "live" in run:
                live = [tuple(t.tolist()) for t in run["live"]]
                assert len(live) == len(workers.LIVE_AFTER)
                assert live == [live[0]] * len(live), (name, live)


@pytest.mark.parametrize("recipe", ["current"])
def test_fsdp_fp8_all_gather_outside_autocast(fsdp_fp8, recipe):
    # Outside autocast the layers compute with the gathered weights rounded to FP8 (the
    # gathered format is fixed at conversion): an independent float64 model with the
    # weights cast to E4M3 by torch, scale 448 / amax, gives the same outputs.
    for result in fsdp_fp8:
        fp8 = result[recipe]["fp8"]
        params = fp8["params_last"]
        x = workers.global_batch(7, 1)[0][:8].double()
        h, h_hp = x, x
        for i in range(3):
            w, b = params[f"{2 * i}.weight"], params[f"{2 * i}.bias"]
            scale = torch.tensor(448.0) / w.abs().max()
            w8 = (w * scale).to(torch.float8_e4m3fn).double() / scale.double()
            h, h_hp = h @ w8.T + b.double(), h_hp @ w.double().T + b.double()
            if i < 2:
                h, h_hp = h.relu(), h_hp.relu()
        torch.testing.assert_close(fp8["eval"].double(), h, rtol=1e-5, atol=1e-6)
        assert (fp8["eval"].double() - h_hp).abs().max() > 1e-3  # not the FP32 weights


def test_fsdp_fp8_precompute_scales_one_all_reduce(fsdp_fp8):
    n_layers = 3
    for result in fsdp_fp8:
        pre, auto = result["current"]["precompute"], result["current"]["fp8"]
        # The same training, bit for bit ...
        assert torch.equal(pre["losses"], auto["losses"])
        for name in auto["params"]:
            assert torch.equal(pre["params"][name], auto["params"][name]), name
        for step in range(1, workers.LEAK_STEPS):
            # ... with one all-reduce of all 3 weight amaxes per step, instead of one per
            # weight (the re-gathers in backward reuse the forward's scale).
            with_pre, without = pre["reductions"][step], auto["reductions"][step]
            assert len(without) - len(with_pre) == n_layers - 1, (step, with_pre, without)
            assert [n_layers, 1] in with_pre.tolist()


def test_fsdp_fp8_all_gather_refusals(fsdp_fp8):
    refusals = fsdp_fp8[0]["refusals"]
    assert refusals["custom"].startswith("NotImplementedError: fastcast.convert: quantized_all")
    assert "CustomRecipe" in refusals["custom"]
    assert refusals["none"].startswith("ValueError: fastcast.convert: quantized_all_gather=True")
    assert refusals["custom.unchanged"] == refusals["none.unchanged"] == "True"
    for result in fsdp_fp8:
        assert "needs fc.autocast(amax_reduction_group=...)" in result["delayed"]["no_group"]


def test_fsdp_fp8_all_gather_dcp(fsdp_fp8):
    # The state dict holds plain shards (no fastcast class in the checkpoint); DCP loads
    # it back into a fresh FP8-gathering model (same forward, bit for bit) and, resharded,
    # into one plain model (same parameters).
    for result in fsdp_fp8:
        dcp_run = result["dcp"]
        assert dcp_run["local_types"] == ["Tensor"]
        assert dcp_run["loaded_types"] == ["FSDPFloat8Weight"] * 3
        assert torch.equal(dcp_run["loaded"], dcp_run["saved"])
    ref = fsdp_fp8[0]["dcp"]
    for name, p in ref["saved_params"].items():
        assert torch.equal(ref["single_params"][name], p), name


@pytest.fixture(scope="module")
def fsdp_fp8_models(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return section(two_ranks, "fsdp_fp8_models")


@pytest.mark.slow  # a Hugging Face Llama per recipe, and its one-process reference
@pytest.mark.parametrize("recipe", FP8AG_RECIPES)
def test_fsdp_fp8_all_gather_hugging_face_llama(fsdp_fp8_models, recipe):
    # A tiny Llama (8 fc.Linear, lm_head included) against one process on all sequences:
    # within FP32 rounding (the ranks' losses add up to its loss).
    ref = fsdp_fp8_models[0][recipe]["llama"]["reference"]
    losses = sum(r[recipe]["llama"]["fp8"]["losses"] for r in fsdp_fp8_models)
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-5, atol=0)
    for name, p in ref["params"].items():
        got = fsdp_fp8_models[0][recipe]["llama"]["fp8"]["params"][name]
        torch.testing.assert_close(got, p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # three more trainings per recipe
@pytest.mark.parametrize("recipe", FP8AG_RECIPES)
@pytest.mark.parametrize("variant", ["fp8_no_reshard", "fp8_checkpointed"])
def test_fsdp_fp8_all_gather_variants(fsdp_fp8_models, recipe, variant):
    # reshard_after_forward=False (no backward re-gather) and activation checkpointing
    # (the recomputation runs on the re-gathered FP8 weight): bit for bit the
    # high-precision gather.
    for result in fsdp_fp8_models:
        runs = result[recipe]["variants"]
        assert torch.equal(runs[variant]["losses"], runs["plain"]["losses"])
        for name, p in runs["plain"]["params"].items():
            assert torch.equal(runs[variant]["params"][name], p), name


@pytest.fixture(scope="module")
def fsdp_fp8_compile(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn("fsdp_fp8_compile", tmp_path_factory.mktemp("fsdp_fp8_compile"))


@pytest.mark.compile
@pytest.mark.slow  # 28 s: two ranks compiling
def test_fsdp_fp8_all_gather_compiled(fsdp_fp8_compile):
    # torch.compile of the FSDP2 model, Float8CurrentScaling (FSDP2's hooks break the
    # graph): the eager outputs and gradients, bit for bit, and every forward GEMM takes
    # its gathered FP8 weight (3 layers, 2 steps).
    for result in fsdp_fp8_compile:
        eager, compiled = result["current"][0], result["current"][1]
        assert compiled["direct"] == eager["direct"] == 3 * 2
        for a, b in zip(compiled["outs"], eager["outs"]):
            assert torch.equal(a, b)
        for ga, gb in zip(compiled["grads"], eager["grads"]):
            assert all(torch.equal(a, b) for a, b in zip(ga, gb))


# -- 9. FSDP2's quantized all-gather, block-scaled recipes -----------------------------------------


@pytest.fixture(scope="module")
def fsdp_qag(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return section(two_ranks, "fsdp_qag")


QAG_RECIPES = list(workers.QAG_RECIPES)
N_QAG_LAYERS = len(workers.QAG_SIZES) - 1


def _quantized_layers(recipe: str) -> int:
    # Float8BlockScaling: the last layer's shards (32 rows) hold no whole 128x128 tile.
    return N_QAG_LAYERS - 1 if recipe == "block" else N_QAG_LAYERS


@pytest.mark.parametrize("recipe", QAG_RECIPES)
def test_fsdp_quantized_all_gather_is_used(fsdp_qag, recipe):
    for result in fsdp_qag:
        q, hp = result[recipe]["q"], result[recipe]["hp"]
        assert q["weight_types"] == ["FSDPFloat8Weight"] * N_QAG_LAYERS
        assert hp["weight_types"] == ["Tensor"] * N_QAG_LAYERS
        # Every forward GEMM of a quantized-gathered layer took its weight as it is.
        assert q["direct"] == _quantized_layers(recipe) * workers.QAG_LEAK_STEPS
        assert hp["direct"] == 0
        if recipe == "block":  # the one weight gathered in high precision, named, once
            (warning,) = q["warnings"]
            assert "fc.Linear '4'" in warning and "(64, 256)" in warning
            assert "not multiples of the 128-row blocks" in warning
        else:
            assert q["warnings"] == []


def _assert_runs_equal(a: dict, b: dict, per_rank: int | None = None) -> None:
    """Losses, gradients (every step) and parameters equal bit for bit; ``per_rank``:
    ``b`` is the one-process run, whose losses are per micro-batch and whose gradients
    are the sum of the ranks' (FSDP2 averages them: exactly half the sum for two)."""
    losses = b["losses"] if per_rank is None else b["losses"][:, per_rank : per_rank + 1]
    assert torch.equal(a["losses"], losses)
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        for name in gb:
            got = ga[name] if per_rank is None else ga[name] * WORLD
            assert torch.equal(got, gb[name]), (step, name, (got - gb[name]).abs().max())
    for name in b["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name


@pytest.mark.parametrize("recipe", QAG_RECIPES)
def test_fsdp_quantized_all_gather_matches_high_precision_gather(fsdp_qag, recipe):
    # The gathered codes and scales are what the recipe's quantizer makes of the whole
    # gathered weight: bit for bit the high-precision gather, 3 steps.
    for result in fsdp_qag:
        _assert_runs_equal(result[recipe]["q"], result[recipe]["hp"])


@pytest.mark.parametrize("recipe", QAG_RECIPES)
def test_fsdp_quantized_all_gather_matches_single_process(fsdp_qag, recipe):
    # One process running the ranks' micro-batches one after the other (each rank's
    # activations are quantized over its own tokens, as data parallelism does): bit for
    # bit, losses, gradients and parameters after 3 steps.
    ref = fsdp_qag[0][recipe]["reference"]
    for rank, result in enumerate(fsdp_qag):
        _assert_runs_equal(result[recipe]["q"], ref, per_rank=rank)


# All-gather bytes of one step against the FP32 gather, forward and backward's re-gather
# (biases included, FP32 in both): FP8 codes and scales <= 0.27x (the forward gathers the
# row-wise layout, the re-gather the column-wise one: 1 byte an element each), NVFP4's
# <= 0.15x (0.30x of a BF16 gather).
QAG_BYTES = {"rowwise": 0.27, "rowwise_gw_hp": 0.27, "block": 0.27, "mxfp8": 0.27, "nvfp4": 0.15}


@pytest.mark.parametrize("recipe", QAG_RECIPES)
def test_fsdp_quantized_all_gather_bytes(fsdp_qag, recipe):
    # (Float8BlockScaling's last layer goes in FP32 in both: left out of the ratio.)
    sizes = workers.QAG_SIZES
    fp32 = 4 * sizes[-1] * sizes[-2] // WORLD if recipe == "block" else 0
    for result in fsdp_qag:
        q, hp = result[recipe]["q"]["bytes"], result[recipe]["hp"]["bytes"]
        for phase in ("forward", "backward"):
            assert q[phase] - fp32 <= QAG_BYTES[recipe] * (hp[phase] - fp32), (q, hp)


@pytest.mark.parametrize("recipe", QAG_RECIPES)
def test_fsdp_quantized_all_gather_no_leak(fsdp_qag, recipe):
    """The same live tensors and storage bytes after steps 4 and 8, and no more after any
    step than after the first. (The first count may be higher by a few small tensors that
    the process's earlier runs, another recipe's or another section's in the shared
    spawn, leave for a later collection: 4 tensors once, here.)"""
    for result in fsdp_qag:
        live = [tuple(t.tolist()) for t in result[recipe]["q"]["live"]]
        assert len(live) == len(workers.QAG_LIVE_AFTER)
        assert live[1:] == [live[1]] * (len(live) - 1), live
        assert all(n <= live[0][0] and b <= live[0][1] for n, b in live), live


@pytest.fixture(scope="module")
def fsdp_qag_models(two_ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return section(two_ranks, "fsdp_qag_models")


@pytest.mark.slow  # three more trainings per recipe
@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("variant", ["fp8_no_reshard", "fp8_checkpointed"])
def test_fsdp_quantized_all_gather_variants(fsdp_qag_models, recipe, variant):
    # No backward re-gather, and activation checkpointing: the high-precision gather's run.
    for result in fsdp_qag_models:
        runs = result[recipe]["variants"]
        assert torch.equal(runs[variant]["losses"], runs["plain"]["losses"])
        for name, p in runs["plain"]["params"].items():
            assert torch.equal(runs[variant]["params"][name], p), name


@pytest.mark.parametrize("recipe", ["rowwise", "nvfp4"])
def test_fsdp_quantized_all_gather_reductions(fsdp_qag, recipe):
    # One all-reduce per quantized weight and step (NVFP4: its amax at the forward gather;
    # row-wise: the in_features column amaxes at backward's re-gather), none for the
    # re-gathers; after precompute_float8_scales, one for all of them, and the same
    # training bit for bit. (Block scaling and MXFP8 reduce nothing.)
    sizes = workers.QAG_SIZES[:-1]
    per_weight = [1] * N_QAG_LAYERS if recipe == "nvfp4" else list(sizes)
    for result in fsdp_qag:
        auto, pre = result[recipe]["q"], result[recipe]["precompute"]
        _assert_runs_equal(pre, auto)
        for step in range(1, workers.QAG_LEAK_STEPS):
            assert sorted(auto["reductions"][step].tolist()) == sorted(
                [n, 1] for n in per_weight
            ), step
            assert pre["reductions"][step].tolist() == [[sum(per_weight), 1]], step
    for result in fsdp_qag:
        assert result["mxfp8"]["q"]["reductions"][1].numel() == 0


@pytest.mark.slow  # two more trainings per recipe
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_fsdp_quantized_all_gather_bf16_params(fsdp_qag_models, recipe):
    # MixedPrecisionPolicy(param_dtype=bf16): each rank quantizes its shard cast to bf16,
    # which is what the GEMMs make of FSDP2's bf16 gather: bit for bit.
    for result in fsdp_qag_models:
        runs = result[recipe]["bf16"]
        assert torch.equal(runs["q"]["losses"], runs["hp"]["losses"])
        for name, p in runs["hp"]["params"].items():
            assert torch.equal(runs["q"]["params"][name], p), name


@pytest.mark.slow  # a Hugging Face Llama per recipe, and its one-process reference
@pytest.mark.parametrize("recipe", ["rowwise", "block", "mxfp8", "nvfp4"])
def test_fsdp_quantized_all_gather_hugging_face_llama(fsdp_qag_models, recipe):
    # A tiny Llama (7 fc.Linear and lm_head; Float8BlockScaling gathers the weights whose
    # shards are not whole 128x128 tiles in high precision): one process running the
    # ranks' sequences as micro-batches, bit for bit.
    ref = fsdp_qag_models[0][recipe]["llama"]["reference"]
    for rank, result in enumerate(fsdp_qag_models):
        got = result[recipe]["llama"]["q"]
        assert torch.equal(got["losses"], ref["losses"][:, rank : rank + 1])
    for name, p in ref["params"].items():
        assert torch.equal(fsdp_qag_models[0][recipe]["llama"]["q"]["params"][name], p), name
