"""Sequence parallelism with the FP8 all-gather of the input: two CPU ranks, gloo.

``fastcast.distributed.QuantizedColwiseParallel(input_layouts=Shard(1))`` against torch's
``ColwiseParallel(input_layouts=Shard(1))`` (which all-gathers the input in high
precision) and against one process. One spawn (``_sp_workers.section_sp_fp8``) shared by
the tests through a module-scoped fixture.
"""

from __future__ import annotations

from typing import Any

import _sp_workers as workers
import pytest
import torch
from _spawn import DISTRIBUTED_MARKS, share, spawn_ranks

pytestmark = DISTRIBUTED_MARKS

WORLD = 2
HARD_TIMEOUT = 120.0  # seconds for the whole spawn; a healthy one takes a few


@pytest.fixture(scope="module")
def sp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("sp_fp8")
    return share(spawn_ranks(workers.entry, "sp_fp8", WORLD, out_dir, HARD_TIMEOUT), ".single")


def assert_equal(a: Any, b: Any, what: str) -> None:
    """Tensors, or dicts/lists of them, equal bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_equal(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{what}[{i}]")
    else:
        assert torch.equal(a, b), what


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


def llama_runs_agree(result: dict[str, Any], recipe: str) -> tuple[dict, dict]:
    """One rank's Llama runs under ``recipe``, ``(fp8 gather, high-precision gather)``,
    after checking that they train bit for bit alike, the FP8 one within FP32 rounding of
    one process, and that the high-precision plan gathers once per column-parallel layer
    and step."""
    fp8, hp = result[f"llama.{recipe}.fp8"], result[f"llama.{recipe}.hp"]
    single = result[f"llama.{recipe}.single"]
    assert_equal(fp8["losses"], hp["losses"], "losses")
    assert_equal(fp8["params"], hp["params"], "params")
    torch.testing.assert_close(fp8["losses"], single["losses"], rtol=1e-5, atol=0)
    assert max_rel(fp8["params"], single["params"]) < 1e-5
    assert hp["calls"]["high_precision"] == 6 * workers.SP_STEPS
    return fp8, hp


@pytest.mark.parametrize("recipe", workers.SP_ALL)
def test_fp8_gather_matches_high_precision_gather_bit_for_bit(sp, recipe):
    """The quantized gather moves the codes and scales the high-precision gather's input
    quantizes to (per-tensor: one global scale, elementwise casts; the others: scales per
    token and, for the weight gradient, column-wise blocks local to each rank's tokens or
    per-feature scales from amaxes reduced over the group): losses, the input and
    parameter gradients, the parameters after 3 steps and the delayed-scaling histories
    are the same bits."""
    for rank, result in enumerate(sp):
        fp8, hp = result[f"{recipe}.fp8"], result[f"{recipe}.hp"]
        for key in ("losses", "grads", "x_grad", "params"):
            assert_equal(fp8[key], hp[key], f"rank {rank} {key}")
        if recipe == "delayed":
            assert_equal(fp8["states"], hp["states"], f"rank {rank} states")
            assert_equal(fp8["states"], sp[0][f"{recipe}.fp8"]["states"], "ranks' states")


@pytest.mark.parametrize("recipe", workers.SP_ALL)
def test_fp8_gather_matches_single_process(sp, recipe):
    """Against the whole sequences in one process: the ranks' losses add up to its loss,
    the parameters after 3 steps agree within FP32 rounding (the row-parallel layer sums
    two partial GEMMs where one process runs one), and the first layer's input amax
    history (each rank's slice's amax, reduced over the group) is the same."""
    ref = sp[0][f"{recipe}.reference"]
    losses = sum(result[f"{recipe}.fp8"]["losses"] for result in sp)
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-5, atol=0)
    for result in sp:
        assert max_rel(result[f"{recipe}.fp8"]["params"], ref["params"]) < 1e-5
    if recipe == "delayed":
        # (Column 0: the input's; the weight's follows the weights, equal within rounding.)
        want = ref["states"][0]["forward.amax_history"][:, 0]
        assert want.max() > 0
        for result in sp:
            got = result[f"{recipe}.fp8"]["states"][0]["forward.amax_history"][:, 0]
            assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", workers.SP_RECIPES)
def test_fp8_gather_bytes_on_the_wire(sp, recipe):
    """The forward's all-gather of the input, counted from the collectives' payloads:
    with the FP8 gather, uint8 codes only (1 byte an element, one collective per forward)
    and no high-precision gather; <= 0.27x the FP32 gather's bytes."""
    for result in sp:
        fp8, hp = result[f"{recipe}.fp8"], result[f"{recipe}.hp"]
        per_step = result[f"{recipe}.fp8"]["local_numel"]
        assert hp["bytes"]["high_precision"] == 4 * per_step * workers.SP_STEPS
        assert hp["bytes"]["uint8"] == 0
        assert fp8["bytes"]["high_precision"] == 0
        assert fp8["calls"]["uint8"] == workers.SP_STEPS
        assert fp8["bytes"]["uint8"] <= 0.27 * hp["bytes"]["high_precision"]


# Each scaled recipe's block along the tokens (its column-wise layout's): the formats'.
# (None: the high-precision weight gradient takes the high-precision gathered input.)
TOKEN_BLOCK = {
    "rowwise": 1,
    "mxfp8": 32,
    "block": 128,
    "nvfp4": 16,
    "nvfp4_sr": 16,
    "block_x2d": 128,
    "rowwise_gw_hp": None,
}


@pytest.mark.parametrize("recipe", workers.SP_SCALED)
def test_scaled_gather_bytes_on_the_wire(sp, recipe):
    """Recipes with scales per token, counted from the collectives' payloads: each forward
    all-gathers the row-wise codes and scales in one uint8 collective (FP8 formats: 132
    bytes a token of 128 features, <= 0.27x the FP32 gather's 512; NVFP4 72, 0.14x), and
    each backward a second one, the column-wise codes and block scales of every rank's
    slice, for the weight gradient (the high-precision path gathers FP32 in forward; its
    backward reduce-scatters the input gradient, as the quantized path does)."""
    fp8_limit = 0.27 if recipe != "nvfp4" else 0.15
    for result in sp:
        fp8, hp = result[f"{recipe}.fp8"], result[f"{recipe}.hp"]
        tokens = fp8["local_tokens"] * workers.SP_STEPS
        assert hp["bytes"] == {
            "uint8": 0,
            "high_precision": 4 * fp8["local_numel"] * workers.SP_STEPS,
        }
        assert hp["backward_bytes"]["uint8"] == 0
        assert fp8["bytes"] == {"uint8": tokens * workers.SP_ROW_BYTES[recipe], "high_precision": 0}
        assert fp8["calls"]["uint8"] == workers.SP_STEPS
        assert fp8["bytes"]["uint8"] <= fp8_limit * hp["bytes"]["high_precision"]
        # (The high-precision ones: the row-parallel layer's output gradient, both paths.)
        assert fp8["backward_bytes"]["high_precision"] == hp["backward_bytes"]["high_precision"]
        assert fp8["backward_calls"]["uint8"] == workers.SP_STEPS
        assert fp8["backward_bytes"]["uint8"] == tokens * workers.SP_COLUMN_BYTES[recipe]


@pytest.mark.parametrize("shape", list(workers.SP_SCALED_SHAPES))
@pytest.mark.parametrize("recipe", workers.SP_LAYER_RECIPES)
def test_scaled_gather_over_input_shapes(sp, recipe, shape):
    """One colwise layer per scaled recipe (and NVFP4 with stochastic rounding, 128x128
    input tiles, the high-precision weight gradient), ``Shard(dim)`` inputs whose per-rank
    runs of tokens are or are not multiples of the recipe's block along the tokens: the
    former gather quantized, the latter (and the high-precision weight gradient, always)
    fall back to the high-precision gather; either way the output (training and no-grad
    forwards), the input and parameter gradients equal the high-precision gather's bit
    for bit."""
    (size, dim) = workers.SP_SCALED_SHAPES[shape]
    run = size[dim] // WORLD * int(torch.tensor(size[dim + 1 : -1]).prod())
    block = TOKEN_BLOCK[recipe]
    quantized = block is not None and run % block == 0
    for rank, result in enumerate(sp):
        fp8, hp = result[f"layer.{recipe}.{shape}.fp8"], result[f"layer.{recipe}.{shape}.hp"]
        assert fp8["fp8_gathers"] == (1 if quantized else 0), rank
        assert hp["fp8_gathers"] == 0
        for key in ("out", "out_eval", "x_grad", "grads"):
            assert_equal(fp8[key], hp[key], f"rank {rank} {key}")


@pytest.mark.parametrize("shape", list(workers.SP_SHAPES))
def test_fp8_gather_over_input_shapes(sp, shape):
    """One colwise layer, ``Shard(dim)`` inputs of several shapes: even slices gather in
    FP8, uneven ones (odd lengths over two ranks) in high precision; either way the
    output (training and no-grad forwards), the input and parameter gradients equal the
    high-precision gather's bit for bit. The gather the no-grad forward reuses is kept
    by fastcast, not on the user's input DTensor (no attribute added to it)."""
    (size, dim) = workers.SP_SHAPES[shape]
    even = size[dim] % WORLD == 0
    for rank, result in enumerate(sp):
        fp8, hp = result[f"layer.{shape}.fp8"], result[f"layer.{shape}.hp"]
        # The no-grad forward of the same input DTensor reuses the training forward's gather.
        assert fp8["fp8_gathers"] == (1 if even else 0), rank
        assert fp8["attributes_added"] == [], rank
        assert hp["fp8_gathers"] == 0
        for key in ("out", "out_eval", "x_grad", "grads"):
            assert_equal(fp8[key], hp[key], f"rank {rank} {key}")


@pytest.mark.parametrize("recipe", workers.SP_RECIPES)
def test_fp8_gather_hugging_face_llama(sp, recipe):
    """A one-layer Hugging Face Llama with torchtitan's sequence-parallel plan, q/k/v,
    gate/up and the head given the sequence-sharded input: 3 steps bit for bit as with
    the high-precision gather, within FP32 rounding of one process (the row-parallel
    o_proj and down_proj sum partial GEMMs). Current scaling shares one gather between
    the layers given the same input (attention, MLP, head: 3 per forward where the
    high-precision plan runs 6: 0.125x its bytes); delayed scaling gathers per layer
    (6, 0.25x)."""
    shared = recipe == "current"
    for result in sp:
        fp8, hp = llama_runs_agree(result, recipe)
        assert fp8["calls"]["high_precision"] == 0
        assert fp8["calls"]["uint8"] == (3 if shared else 6) * workers.SP_STEPS
        ratio = fp8["bytes"]["uint8"] / hp["bytes"]["high_precision"]
        assert ratio == (0.125 if shared else 0.25)


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_scaled_gather_hugging_face_llama(sp, recipe):
    """The Llama of ``test_fp8_gather_hugging_face_llama`` over 64 tokens a sequence with
    the row-wise and MXFP8 recipes: 3 steps bit for bit as with the high-precision gather,
    within FP32 rounding of one process. The layers given the same input share the
    forward's gather (3 per forward, each 132 bytes a token where the high-precision
    plan's 6 move 512: 0.129x its bytes); each of the 6 column-parallel layers gathers
    the column-wise layout of its input in backward."""
    for result in sp:
        fp8, hp = llama_runs_agree(result, recipe)
        assert hp["backward_calls"]["uint8"] == 0
        assert fp8["calls"] == {"uint8": 3 * workers.SP_STEPS, "high_precision": 0}
        assert fp8["backward_calls"]["uint8"] == 6 * workers.SP_STEPS
        ratio = fp8["bytes"]["uint8"] / hp["bytes"]["high_precision"]
        assert ratio == (3 * workers.SP_ROW_BYTES[recipe]) / (6 * 4 * workers.TP_IN)


@pytest.mark.parametrize("recipe", workers.SP_ALL)
def test_fp8_gather_under_activation_checkpointing(sp, recipe):
    """``torch.utils.checkpoint`` around the layer: the forward gathers in FP8; the
    recomputation in backward (after the autocast exited: the style gathers in high
    precision there, the layer replays the original call's scales) quantizes the same
    codes, so output and gradients equal the high-precision gather's bit for bit."""
    for rank, result in enumerate(sp):
        fp8, hp = result[f"checkpointed.{recipe}.fp8"], result[f"checkpointed.{recipe}.hp"]
        # (1x128 blocks: runs of 32 tokens, the high-precision fallback.)
        assert fp8["fp8_gathers"] >= (0 if recipe == "block" else 1), rank
        for key in ("out", "out_eval", "x_grad", "grads"):
            assert_equal(fp8[key], hp[key], f"rank {rank} {key}")
