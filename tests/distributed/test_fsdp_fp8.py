"""``fc.convert(..., quantized_all_gather=True)`` in one process: the wrapped weight
behaves as the plain one, and the block-scaled recipes' gathered weight (its layouts,
its dequantized value) on a group of one rank. The two-rank FSDP2 tests are in
``test_distributed.py``, sections ``fsdp_fp8`` (per-tensor recipes) and ``fsdp_qag``."""

from __future__ import annotations

import copy
import io
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fastcast as fc
from fastcast.distributed.fsdp import (
    FSDPFloat8Weight,
    GatheredFloat8Weight,
    blocks,
    gathered,
)
from fastcast.reference.decode import unpack_e2m1

RECIPES = {
    "current": fc.Float8CurrentScaling,
    "delayed": lambda: fc.DelayedScaling(amax_history_len=4),
}


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))


def train(model: nn.Module, recipe: fc.Recipe, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        with fc.autocast(recipe=recipe):
            loss = model(x).square().mean()
        loss.backward()
        out += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", RECIPES)
def test_wrapped_weight_trains_like_the_plain_one(name):
    recipe = RECIPES[name]()
    plain = fc.convert(mlp(), recipe=recipe, keep_head=False)
    wrapped = fc.convert(mlp(), recipe=recipe, quantized_all_gather=True, keep_head=False)
    weight = wrapped[0].weight
    assert isinstance(weight, FSDPFloat8Weight) and isinstance(weight, nn.Parameter)
    assert weight.is_leaf and weight.requires_grad and weight.dtype == torch.float32
    for a, b in zip(train(plain, recipe), train(wrapped, recipe)):
        assert torch.equal(a, b)
    assert isinstance(wrapped[0].weight, FSDPFloat8Weight)  # the optimizer kept it


def test_state_dict_holds_plain_tensors():
    model = fc.convert(mlp(), recipe=fc.Float8CurrentScaling(), quantized_all_gather=True)
    sd = model.state_dict()
    assert type(sd["0.weight"]) is torch.Tensor
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # no class of fastcast's in the file
    target = mlp(seed=1)
    target.load_state_dict({k: v for k, v in loaded.items() if "extra" not in k})
    assert torch.equal(target[0].weight, model[0].weight._tensor)
    # Loading into the wrapped model writes into the wrapped tensor.
    model.load_state_dict(fc.convert(mlp(seed=2)).state_dict())
    assert isinstance(model[0].weight, FSDPFloat8Weight)
    assert torch.equal(model[0].weight._tensor, mlp(seed=2)[0].weight)
    assert torch.equal(copy.deepcopy(model)[0].weight._tensor, model[0].weight._tensor)


def test_refusals_leave_the_model_as_it_was():
    model = mlp()
    custom = fc.CustomRecipe(qfactory=lambda role: None)
    with pytest.raises(NotImplementedError, match="quantized_all_gather.*CustomRecipe"):
        fc.convert(model, recipe=custom, quantized_all_gather=True)
    with pytest.raises(ValueError, match="quantized_all_gather=True needs recipe"):
        fc.convert(model, quantized_all_gather=True)
    assert type(model[0]) is nn.Linear and type(model[0].weight) is nn.Parameter


def test_gathered_weight_computes_with_its_dequantized_value():
    # The gathered weight outside the GEMMs it was cast for: codes * scale_inv, checked
    # against float64 from torch's own E4M3 cast (FP32 GEMM: rounding tolerance).
    w = torch.randn(32, 64)
    scale = 448.0 / w.abs().max()
    codes = (w * scale).to(torch.float8_e4m3fn)
    gathered = GatheredFloat8Weight(
        codes.view(torch.uint8), scale.reciprocal(), None, "e4m3", w.dtype
    )
    x = torch.randn(8, 64)
    expected = x.double() @ (codes.double() / scale.double()).T
    torch.testing.assert_close(F.linear(x, gathered).double(), expected, rtol=1e-5, atol=1e-5)
    # No quantizer: no GEMM takes it as its operand.
    assert gathered.fc_quantized(None, True) is None


# -- the block-scaled recipes --------------------------------------------------------------

BLOCK_RECIPES = {
    "rowwise": fc.Float8RowwiseScaling,
    "rowwise_gw_hp": lambda: fc.Float8RowwiseScaling(wgrad_high_precision=True),
    "block": fc.Float8BlockScaling,
    "block_1x128": lambda: fc.Float8BlockScaling(w_block_scaling_dim=1),
    "mxfp8": fc.MXFP8BlockScaling,
    # (stochastic rounding draws from the global generator: the runs would differ)
    "nvfp4": lambda: fc.NVFP4BlockScaling(stochastic_rounding=False),
    "nvfp4_1x16": lambda: fc.NVFP4BlockScaling(stochastic_rounding=False, weight_2d_blocks=False),
}


@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_block_recipes_wrapped_weight_trains_like_the_plain_one(name):
    recipe = BLOCK_RECIPES[name]()
    plain = fc.convert(mlp(), recipe=recipe, keep_head=False)
    wrapped = fc.convert(mlp(), recipe=recipe, quantized_all_gather=True, keep_head=False)
    assert isinstance(wrapped[0].weight, FSDPFloat8Weight)
    for a, b in zip(train(plain, recipe), train(wrapped, recipe)):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A one-rank gloo group in this process: FSDP2 runs its hooks (gathers of one)."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def wide_mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_block_recipes_fully_shard_of_one_rank_is_the_plain_model(world_of_one, name):
    # fully_shard on one rank (FSDP2 hands a group of one only the first all-gather
    # input over): the weight goes as it is, no warning, and the GEMMs quantize it as
    # in the plain model, bit for bit.
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    recipe = BLOCK_RECIPES[name]()
    plain = fc.convert(wide_mlp(), recipe=recipe, keep_head=False)
    sharded = fc.convert(wide_mlp(), recipe=recipe, quantized_all_gather=True, keep_head=False)
    mesh = init_device_mesh("cpu", (1,))
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = train(sharded, recipe)
    for a, b in zip(train(plain, recipe), got):
        assert torch.equal(a, getattr(b, "full_tensor", lambda: b)())


def _shard_and_group(name: str, world_of_one: Any) -> tuple:
    recipe = BLOCK_RECIPES[name]()
    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(11)) * 3
    return recipe, w, FSDPFloat8Weight(w, recipe, "layer"), blocks.weight_quantizer(recipe)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


@pytest.mark.parametrize("name", ["rowwise", "block_1x128", "mxfp8", "nvfp4_1x16"])
def test_split_layouts_column_wise_operand_waits_for_backward_gather(world_of_one, name):
    # The forward's gather carries the row-wise layout: the column-wise operand it hands
    # to autograd views the codes buffer and holds NaN scales until backward's gather
    # writes the column-wise layout into the same buffers (as FSDP2 refills them); then
    # it is the quantizer's column-wise layout of the whole weight.
    recipe, w, shard, quantizer = _shard_and_group(name, world_of_one)
    inputs, wire = blocks.wire_inputs(shard, quantizer, "row", world_of_one, w.shape, None)
    buffers = tuple(t.clone() for t in inputs)  # one rank: the gathered inputs
    weight, _ = gathered.post_all_gather(buffers, wire, w.dtype, None)
    saved = weight.fc_quantized(quantizer, True).columnwise_operand()
    assert torch.isnan(saved.dequantize()).all()
    inputs, wire = blocks.wire_inputs(shard, quantizer, "col", world_of_one, w.shape, None)
    assert [t.numel() * t.element_size() for t in inputs] == [b.nbytes for b in buffers]
    for buffer, t in zip(buffers, inputs):
        buffer.view(-1).copy_(t.reshape(-1).view(buffer.dtype))
    assert gathered.post_all_gather(buffers, wire, w.dtype, weight) is None
    expected = quantizer.quantize(w, rowwise=True, columnwise=True).columnwise_operand()
    assert torch.equal(_bytes_of(saved.data), _bytes_of(expected.data))
    assert torch.equal(_bytes_of(saved.scale_inv), _bytes_of(expected.scale_inv))


@pytest.mark.parametrize("name", ["block", "mxfp8", "nvfp4"])
def test_gathered_block_weight_computes_with_its_dequantized_value(world_of_one, name):
    # Outside the GEMMs it was cast for, the gathered weight is codes times scales:
    # checked against float64 from the codes and scales, expanded over their blocks here.
    recipe, w, shard, quantizer = _shard_and_group(name, world_of_one)
    inputs, wire = blocks.wire_inputs(shard, quantizer, "both", world_of_one, w.shape, None)
    weight, _ = gathered.post_all_gather(tuple(inputs), wire, w.dtype, None)
    q = quantizer.quantize(w)
    if name == "nvfp4":
        values = unpack_e2m1(q.data).double()
        scales = q.scale_inv.double() * q.global_scale_inv.double()
    elif name == "mxfp8":
        values, scales = q.data.double(), torch.exp2(q.scale_inv.double() - 127)
    else:
        values, scales = q.data.double(), q.scale_inv.double()
    rows, cols = q.block
    rows = rows or w.shape[0]
    full = scales.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)
    w64 = values * full[:, : w.shape[1]]
    x = torch.randn(8, 64)
    torch.testing.assert_close(
        F.linear(x, weight).double(), x.double() @ w64.T, rtol=1e-5, atol=1e-5
    )
    assert weight.fc_quantized(None, True) is None  # another quantizer: not its operand


def test_unaligned_shards_are_named():
    q = blocks.weight_quantizer(fc.Float8BlockScaling())
    assert blocks.unaligned(q, 256, 2) == ""
    assert "shards of 32 rows are not multiples of the 128-row blocks" in blocks.unaligned(q, 64, 2)
    assert "do not split into 2 equal shards" in blocks.unaligned(q, 255, 2)
    rowwise = blocks.weight_quantizer(fc.Float8RowwiseScaling())
    assert blocks.unaligned(rowwise, 6, 2) == "" and blocks.unaligned(rowwise, 7, 2) != ""


def test_conv1d_keeps_the_high_precision_gather_for_block_recipes():
    # fc.Conv1D stores [in, out]: FSDP2's shards are not the blocks the GEMMs quantize.
    transformers = pytest.importorskip("transformers")
    model = nn.Sequential(transformers.pytorch_utils.Conv1D(32, 64))
    with pytest.warns(UserWarning, match="stores its weight transposed.*MXFP8BlockScaling"):
        fc.convert(model, recipe=fc.MXFP8BlockScaling(), quantized_all_gather=True)
    assert type(model[0].weight) is nn.Parameter


def _layers(q: Any) -> list[torch.Tensor]:
    """The bytes of both layouts' codes and scales (and NVFP4's tensor scale)."""
    names = ("data", "scale_inv", "data_t", "scale_inv_t", "global_scale_inv")
    return [_bytes_of(getattr(q, n)) for n in names if getattr(q, n, None) is not None]


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(sorted(BLOCK_RECIPES)),
    rows=st.sampled_from([128, 256]),
    cols=st.sampled_from([32, 64, 160]),
    passes=st.lists(st.sampled_from(["row", "col"]), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_gathered_weight_state_through_any_sequence_of_gathers(
    world_of_one, name, rows, cols, passes, seed
):
    # Any sequence of forward ("row") and backward ("col") gathers into the same buffers,
    # the weight changing in between. After a forward gather the row-wise layout is the
    # quantizer's, byte for byte, and the column-wise scales are NaN (until a backward
    # gather); after a backward gather both layouts are (the row-wise one gathered by a
    # collective of its own). Square tiles gather one layout, both always right.
    recipe = BLOCK_RECIPES[name]()
    quantizer = blocks.weight_quantizer(recipe)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    shard = FSDPFloat8Weight(w.clone(), recipe, "layer")
    split = not blocks.transposable(quantizer)
    buffers = weight = None
    for step, kind in enumerate(passes):
        if step:
            shard._tensor.mul_(1.5).add_(0.25)  # an optimizer step (a new version)
        layout = kind if split else "one"
        inputs, wire = blocks.wire_inputs(shard, quantizer, layout, world_of_one, w.shape, None)
        wire.source, wire.group = shard, world_of_one
        # As FSDP2 does: flat buffers of the first gather's sizes and dtypes, refilled,
        # handed over as views shaped like each gather's inputs.
        if buffers is None:
            buffers = [t.reshape(-1).clone() for t in inputs]
        for buffer, t in zip(buffers, inputs):
            buffer.copy_(t.reshape(-1).view(buffer.dtype))
        views = tuple(b.view(t.dtype).view(t.shape) for b, t in zip(buffers, inputs))
        if weight is None:
            weight, _ = gathered.post_all_gather(views, wire, w.dtype, None)
        else:
            gathered.post_all_gather(views, wire, w.dtype, weight)
        expected = quantizer.quantize(shard._tensor, rowwise=True, columnwise=True)
        got = weight.fc_quantized(quantizer, True)
        if layout == "row":
            assert torch.isnan(got.columnwise_operand().dequantize()).all()
            got.data_t = got.scale_inv_t = expected.data_t = expected.scale_inv_t = None
        for a, b in zip(_layers(got), _layers(expected), strict=True):
            assert torch.equal(a, b), (name, passes, step)
