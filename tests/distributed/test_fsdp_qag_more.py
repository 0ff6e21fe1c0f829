"""FSDP2's quantized all-gather (``fc.convert(..., quantized_all_gather=True)``), every
recipe, beyond ``test_distributed.py``'s two-rank training: gradient accumulation with
``is_first_microbatch``, 4 ranks, uneven shards, ``torch.compile`` and DCP (gloo, CPU;
workers in ``_qag_workers.py``, one spawn per module-scoped fixture)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _qag_workers as workers
import pytest
import torch
from _bounds import U, assert_sum_rounding, sum_orders_bound
from _spawn import DISTRIBUTED_MARKS, share, spawn_ranks

pytestmark = DISTRIBUTED_MARKS

HARD_TIMEOUT = 240.0  # seconds for a whole spawn; a healthy one takes well under a minute
# A compiling spawn's guard: each rank compiles its graphs itself, and from an empty Inductor
# cache on two busy cores that alone took over 240 s.
COMPILE_TIMEOUT = 600.0


def spawn(
    section: str, world: int, out_dir: Path, timeout: float = HARD_TIMEOUT
) -> list[dict[str, Any]]:
    return spawn_ranks(workers.entry, section, world, out_dir, timeout)


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


def states_equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) > 0 and all(
        sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        for sa, sb in zip(a, b)
    )


def assert_same_run(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert torch.equal(a["losses"], b["losses"]), what
    for name, p in b["params"].items():
        assert torch.equal(a["params"][name], p), (what, name)


# -- 1. gradient accumulation: is_first_microbatch with the quantized gather -----------------


@pytest.fixture(scope="module")
def qag_two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn("qag_two", 2, tmp_path_factory.mktemp("qag_two"))


@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_accumulation_keeps_the_gathered_quantized_weight(qag_two, recipe):
    """``reshard_after_forward=False`` and the weights kept gathered until the last
    micro-batch's backward (``set_reshard_after_backward``), gradient sync on the last
    micro-batch only: one quantized gather per weight and step, every forward GEMM of
    every micro-batch takes that gathered weight, and the run equals the high-precision
    gather's (``is_first_microbatch`` keeping the quantized weight there) bit for bit,
    and one process on the same micro-batches within FP32 rounding."""
    layers, ref = 2, qag_two[0][f"{recipe}.reference"]
    losses = 0
    for rank, result in enumerate(qag_two):
        run = result[f"{recipe}.keep"]
        assert run["gathers"] == [layers] * workers.STEPS, rank
        assert run["direct"] == [layers * workers.MICRO] * workers.STEPS, rank
        assert result[f"{recipe}.keep_hp"]["gathers"] == [0] * workers.STEPS
        assert_same_run(run, result[f"{recipe}.keep_hp"], f"rank {rank}")
        assert max_rel(run["params"], ref["params"]) < 1e-5, rank
        losses = losses + run["losses"]
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-6, atol=0)
    assert losses[-1].sum() < losses[0].sum()


@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_accumulation_regathers_each_micro_batch(qag_two, recipe):
    """FSDP2's default ``reshard_after_forward=True``: each micro-batch gathers its
    weights quantized in forward and again in backward, the flag notwithstanding, and
    the run equals the high-precision gather's bit for bit. An unchanged weight gives the
    same codes at every gather, so (but for DelayedScaling, whose scale moves after each
    micro-batch while a kept weight keeps the first one's) it also equals the run that
    keeps the weights gathered."""
    layers = 2
    for rank, result in enumerate(qag_two):
        run = result[f"{recipe}.regather"]
        assert run["gathers"] == [2 * layers * workers.MICRO] * workers.STEPS, rank
        assert run["direct"] == [layers * workers.MICRO] * workers.STEPS, rank
        assert_same_run(run, result[f"{recipe}.regather_hp"], f"rank {rank}")
        if recipe != "delayed":
            assert_same_run(run, result[f"{recipe}.keep"], f"rank {rank}")


@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_accumulation_forward_after_the_backward_regather(qag_two, recipe):
    """``reshard_after_forward=True`` with the weights kept gathered after the backward
    of all but the last micro-batch: the next forward takes the weight backward's
    re-gather left (row-wise and MXFP8 carry the column-wise layout there, and that
    forward gathers the row-wise one itself), with the same codes: the run equals the
    one that keeps the forward's gather, bit for bit."""
    layers = 2
    for rank, result in enumerate(qag_two):
        run = result[f"{recipe}.after_backward"]
        # The first micro-batch gathers in forward and backward, the second in backward.
        assert run["gathers"] == [layers * (2 * workers.MICRO - 1)] * workers.STEPS, rank
        assert run["direct"] == [layers * workers.MICRO] * workers.STEPS, rank
        assert_same_run(run, result[f"{recipe}.keep"], f"rank {rank}")


# -- 2. four ranks, every recipe; 3. uneven shards ------------------------------------------


@pytest.fixture(scope="module")
def qag_four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return share(spawn("qag_four", 4, tmp_path_factory.mktemp("qag_four")))


# The quantized gathers of each recipe (forward, backward alike) against the FP32 gather's.
FP8_BOUND, FP4_BOUND = 0.27, 0.15


def fp32_gather_bytes(out_features: int, in_features: int, world: int) -> int:
    """What each rank sends in FSDP2's FP32 all-gather of a layer's weight and bias: the
    padded shard (``ceil(out / world)`` rows) of each."""
    rows = -(-out_features // world)
    return 4 * rows * (in_features + 1)


@pytest.mark.slow  # the 4-rank spawn: 48 s
@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_four_ranks_match_one_process(qag_four, recipe):
    """4 gloo ranks, every recipe, 3 SGD steps with the quantized gather, against one
    process (all ranks' rows at once; each rank's rows as a micro-batch for
    ``PER_RANK_REFERENCE``) that starts each step from the ranks' parameters (see
    ``workers.four_run``: quantization is a step function, so two trajectories that
    differ by FP32 rounding part by whole FP8 steps, at a step that depends on the
    CPU's GEMM kernels). Each step's loss (summed over the ranks), gradients (times 4:
    FSDP2 averages) and parameters after it are the single process's within the
    rounding of the one sum that the two add in another order; every forward GEMM of an
    fc.Linear takes its gathered weight.

    Bounds (``_bounds.sum_orders_bound``): a gradient is a sum over the 128 tokens (one GEMM in
    one process, 4 GEMMs of 32 and the reduce-scatter in FSDP2): 2 * 127 * U = 1.5e-5
    (measured: 1e-7). A loss is a sum of 128 x 6 squares (no
    cancellation): 9.1e-5 relative. A parameter after a step from the same parameters,
    ``p - lr * g``, differs by lr times the gradients' difference and at most one
    rounding of the update on each side (2 U of the parameter's norm)."""
    ref = qag_four[0][f"{recipe}.reference"]
    world = len(qag_four)
    tokens = world * workers.LOCAL_BATCH
    fc_layers = 3 if recipe in workers.PER_TENSOR else 2
    losses = 0
    measured = []
    for rank, result in enumerate(qag_four):
        q = result[f"{recipe}.q"]
        assert q["direct"] == fc_layers * workers.FOUR_STEPS, rank
        for step in range(workers.STEPS):
            grads = {n: g * world for n, g in q["grads"][step].items()}
            want = ref["grads"][step]
            measured.append((max_rel(grads, want), max_rel(q["params"][step], ref["params"][step])))
            assert measured[-1][0] < sum_orders_bound(tokens), (rank, step, measured[-1])
            for name, p in q["params"][step].items():
                slack = workers.LR * (grads[name] - want[name]).norm() + 2 * U * p.norm()
                assert (p - ref["params"][step][name]).norm() <= slack, (rank, step, name)
                # All ranks hold one model.
                assert torch.equal(p, qag_four[0][f"{recipe}.q"]["params"][step][name])
        losses = losses + q["losses"]
    bound = sum_orders_bound(tokens * workers.FOUR_SIZES[-1])
    torch.testing.assert_close(losses, ref["losses"], rtol=bound, atol=0)
    loss_rel = ((losses - ref["losses"]).abs() / ref["losses"]).max().item()
    worst = [max(m[i] for m in measured) for i in (0, 1)]
    print(f"\n4 ranks {recipe}: losses {loss_rel:.1e}, grads {worst[0]:.1e}, params {worst[1]:.1e}")


@pytest.mark.slow  # the 4-rank spawn: 48 s
@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_four_ranks_bytes(qag_four, recipe):
    """Each fc.Linear's forward and backward all-gather against the FP32 gather's, 4 ranks:
    <= 0.27x (FP8 recipes), <= 0.15x (NVFP4: 0.30x of a BF16 gather). The per-tensor
    recipes' last layer (6 rows: shards of 2, 2, 2 and 0 rows) goes padded and quantized;
    the others' last layer is an nn.Linear, gathered in FP32 with the root's parameters
    (first, and not again in backward)."""
    bound = FP4_BOUND if recipe == "nvfp4" else FP8_BOUND
    world = len(qag_four)
    sizes = workers.FOUR_SIZES
    fp32 = [fp32_gather_bytes(o, i, world) for i, o in zip(sizes, sizes[1:])]
    for rank, result in enumerate(qag_four):
        sent = result[f"{recipe}.q"]["bytes"]
        if recipe in workers.PER_TENSOR:
            ratios = [b / f for b, f in zip(sent["forward"], fp32, strict=True)]
            assert sent["backward"] == sent["forward"][::-1], rank  # re-gathered alike
            assert result[f"{recipe}.q"]["warnings"] == []
        else:
            root, *layers = sent["forward"]
            assert root == fp32[2], rank  # the nn.Linear, with the root
            ratios = [b / f for b, f in zip(layers, fp32[:2], strict=True)]
            assert sent["backward"] == layers[::-1], rank
        assert all(r <= bound for r in ratios), (rank, ratios)
        if rank == 0:
            total = (sum(sent["forward"])) / sum(fp32)
            shown = ", ".join(f"{r:.3f}" for r in ratios)
            print(f"\n4 ranks {recipe}: fc.Linear gathers vs FP32 {shown}; all {total:.3f}")


@pytest.mark.slow  # the 4-rank spawn: 48 s
@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_four_ranks_no_leak(qag_four, recipe):
    """No growth on any rank (the per-tensor recipes' last layer with its padded shards,
    and rank 3's empty one, included): the same live tensors and storage bytes after
    steps 2 and 4, and no more after any step than after the first. (The first count
    may be higher by a few small tensors that the process's previous run, another
    recipe's, leaves for its next collection.)"""
    for rank, result in enumerate(qag_four):
        live = result[f"{recipe}.q"]["live"]
        assert len(live) == 3 and torch.equal(live[1], live[2]), (rank, live)
        assert all((v <= live[0]).all() for v in live), (rank, live)


# -- 4. torch.compile of an FSDP2 model with the quantized gather --------------------------------


@pytest.fixture(scope="module")
def qag_compile(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn("qag_compile", 2, tmp_path_factory.mktemp("qag_compile"), COMPILE_TIMEOUT)


@pytest.mark.compile
@pytest.mark.slow  # 70 s: two ranks compiling
def test_compiled_fsdp2_with_the_quantized_gather(qag_compile):
    """``torch.compile`` of an FSDP2 model with the quantized gather, 2 ranks, 2 SGD steps,
    against eager, bit for bit (outputs and gradients): block's square tiles, whose graph
    takes the gathered weight, and MXFP8's split layouts (FSDP2's default re-gather),
    whose graph quantizes the dequantized weight.

    Within FP32 rounding, not bit for bit: the two run other kernels for the same sums.
    Eager adds the bias after its GEMM (``at::mm``, then the bias), the compiled graph
    runs ``addmm`` with the bias in the GEMM (MKL's kernel for this CPU orders the adds);
    eager sums a bias gradient with ATen's cascade sum, Inductor with a loop of its own.
    Bound (``_bounds``): an output is a sum of 256 products and the bias, a bias gradient
    one of 2 x 32 tokens' gradients: 2 * 256 * U (3.1e-5) relative; measured 3e-8 on an
    AVX2 EPYC."""
    terms = workers.ACC_SIZES[1] + 1
    for result in qag_compile:
        for name, reshard in workers.COMPILE_CASES:
            eager = result[f"{name}.{reshard}.eager"]
            compiled = result[f"{name}.{reshard}.compiled"]
            assert eager["error"] == compiled["error"] == "", (name, reshard)
            assert compiled["autocast_closed"]
            for step, (a, b) in enumerate(zip(compiled["outs"], eager["outs"], strict=True)):
                assert_sum_rounding(a, b, terms, (name, reshard, step))
            for step, (ga, gb) in enumerate(zip(compiled["grads"], eager["grads"], strict=True)):
                for i, (a, b) in enumerate(zip(ga, gb, strict=True)):
                    assert_sum_rounding(a, b, terms, (name, reshard, step, i))


# -- 5. DCP with the quantized gather -----------------------------------------------------------


@pytest.mark.parametrize("recipe", workers.RECIPES)
def test_dcp_with_the_quantized_gather(qag_two, recipe):
    """Every recipe: an FSDP2 model with the quantized gather, trained 2 steps on 2 ranks
    and saved with DCP (its state dict holds plain tensors), loads into a fresh such model
    (the same parameters and delayed states, the same forward, and the same parameters
    after one more step, bit for bit) and, in one process, into one plain model
    converted without a recipe (the same parameters, delayed states and forward)."""
    for rank, result in enumerate(qag_two):
        r = result[f"dcp.{recipe}"]
        assert r["types"] == ["Tensor"], r["types"]
        for key in ("loaded_params", "next_params"):
            want = r["params"] if key == "loaded_params" else r["loaded_next_params"]
            for name, p in want.items():
                assert torch.equal(r[key][name], p), (rank, key, name)
        assert torch.equal(r["loaded_forward"], r["forward"]), rank
        if recipe == "delayed":
            assert states_equal(r["loaded_states"], r["states"])
    r = qag_two[0][f"dcp.{recipe}"]
    for name, p in r["params"].items():
        assert torch.equal(r["single_params"][name], p), name
    if recipe == "delayed":
        assert states_equal(r["single_states"], r["states"])
    assert torch.equal(r["single_forward"], r["forward"])
