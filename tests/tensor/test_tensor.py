"""Quantized tensor storage: flatten/unflatten, the storage registry, sizes and layouts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fastcast.quantizers import (
    BlockScalingQuantizer,
    CurrentScalingQuantizer,
    FixedScaleQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from fastcast.tensor import (
    STORAGE,
    Float8Tensor,
    MXFP8Tensor,
    NVFP4Tensor,
    QuantizedTensor,
    register_storage,
)


def sample(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    k = torch.randint(-4, 5, tuple(shape[:-1]) + (1,), generator=g)
    return (x * torch.pow(2.0, k.double())).to(dtype)


# name -> (builder, the class it builds)
BUILDERS = {
    "tensorwise": (lambda x: CurrentScalingQuantizer().quantize(x, columnwise=True), Float8Tensor),
    "tensorwise-rowwise-only": (
        lambda x: CurrentScalingQuantizer(fmt="e5m2").quantize(x),
        Float8Tensor,
    ),
    "tensorwise-columnwise-only": (
        lambda x: CurrentScalingQuantizer().quantize(x, rowwise=False, columnwise=True),
        Float8Tensor,
    ),
    "block-1x128": (
        lambda x: BlockScalingQuantizer(block_dim=1).quantize(x, columnwise=True),
        Float8Tensor,
    ),
    "block-128x128": (
        lambda x: BlockScalingQuantizer(block_dim=2, power_2_scales=False).quantize(
            x, columnwise=True
        ),
        Float8Tensor,
    ),
    "mxfp8": (lambda x: MXFP8Quantizer().quantize(x, columnwise=True), MXFP8Tensor),
    "nvfp4": (lambda x: NVFP4Quantizer().quantize(x, columnwise=True), NVFP4Tensor),
    "nvfp4-2d": (lambda x: NVFP4Quantizer(block_2d=True).quantize(x, columnwise=True), NVFP4Tensor),
}


def build(name, shape=(64, 160), dtype=torch.float32, seed=1):
    fn, cls = BUILDERS[name]
    q = fn(sample(shape, dtype, seed))
    assert type(q) is cls
    return q


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal values, NaN equal to NaN."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        and torch.equal(a.isnan(), b.isnan())
    )


def layouts(q):
    return [n for n in type(q).inner_names if getattr(q, n) is not None]


# -- flatten / unflatten -----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_flatten_unflatten_round_trip(name):
    q = build(name, dtype=torch.bfloat16)
    names, ctx = q.__tensor_flatten__()
    assert names == layouts(q)
    assert ctx["storage"] == q.storage_name
    inner = {n: getattr(q, n) for n in names}

    # rebuilt through the concrete class and through the base class (by storage name)
    for klass in (type(q), QuantizedTensor):
        rebuilt = klass.__tensor_unflatten__(inner, ctx, q.shape, None)
        assert type(rebuilt) is type(q)
        assert rebuilt.fmt == q.fmt and rebuilt.shape == q.shape and rebuilt.dtype == q.dtype
        assert rebuilt.block == q.block and rebuilt.block_t == q.block_t
        for n in type(q).inner_names:
            assert getattr(rebuilt, n) is getattr(q, n)
        assert same(rebuilt.dequantize(), q.dequantize())
        assert same(rebuilt.dequantize(torch.float32), q.dequantize(torch.float32))
        if q.has_rowwise:
            assert same(rebuilt.dequantize_rowwise_2d(), q.dequantize_rowwise_2d())
        if q.has_columnwise:
            assert same(
                rebuilt.columnwise_operand().dequantize(), q.columnwise_operand().dequantize()
            )
        assert rebuilt.nbytes == q.nbytes
        assert repr(rebuilt) == repr(q)


@pytest.mark.parametrize("name", ["tensorwise", "nvfp4", "block-1x128"])
def test_flatten_context_is_plain_data(name):
    # A codec can store the context as JSON (tuples come back as lists) and rebuild it.
    q = build(name, shape=(2, 16, 160))
    names, ctx = q.__tensor_flatten__()
    restored = json.loads(json.dumps(ctx))
    inner = {n: getattr(q, n).clone() for n in names}
    rebuilt = QuantizedTensor.__tensor_unflatten__(inner, restored, None, None)
    assert isinstance(rebuilt.block, tuple) and isinstance(rebuilt.shape, torch.Size)
    assert rebuilt.shape == q.shape
    assert same(rebuilt.dequantize(), q.dequantize())


def test_nvfp4_global_scale_survives_unflatten():
    q = build("nvfp4", shape=(32, 64))
    names, ctx = q.__tensor_flatten__()
    assert "global_scale_inv" in names
    inner = {n: getattr(q, n) for n in names}
    inner["global_scale_inv"] = q.global_scale_inv * 2
    rebuilt = NVFP4Tensor.__tensor_unflatten__(inner, ctx)
    assert rebuilt.global_scale_inv.item() == 2 * q.global_scale_inv.item()
    # every dequantized value doubles (exactly: a power-of-two factor)
    assert same(rebuilt.dequantize(), q.dequantize() * 2)


def test_unflatten_refuses_a_non_dtype():
    q = build("tensorwise-rowwise-only")
    names, ctx = q.__tensor_flatten__()
    with pytest.raises(ValueError, match="dtype"):
        QuantizedTensor.__tensor_unflatten__({"data": q.data}, dict(ctx, dtype="Size"))


# -- storage registry --------------------------------------------------------------------------
def test_storage_registry():
    assert STORAGE["float8"] is Float8Tensor
    assert STORAGE["mxfp8"] is MXFP8Tensor
    assert STORAGE["nvfp4"] is NVFP4Tensor
    for name, cls in STORAGE.items():
        assert cls.storage_name == name and issubclass(cls, QuantizedTensor)
    # re-registering the same class is harmless
    assert register_storage(Float8Tensor) is Float8Tensor

    class Impostor(QuantizedTensor):
        storage_name = "float8"
        family = "float8"
        __slots__ = ()

    before = dict(STORAGE)
    with pytest.raises(ValueError, match="float8"):
        register_storage(Impostor)
    assert STORAGE == before

    class Fresh(QuantizedTensor):
        storage_name = "test-only-fresh-storage"
        family = "float8"
        __slots__ = ()

    try:
        assert register_storage(Fresh) is Fresh
        assert STORAGE["test-only-fresh-storage"] is Fresh
    finally:
        STORAGE.pop("test-only-fresh-storage", None)


# -- sizes, shape, dtype -----------------------------------------------------------------------
def test_nbytes():
    rows, cols = 64, 160
    # per-tensor, row-wise only: one byte per element and one FP32 scale
    q = build("tensorwise-rowwise-only", (rows, cols))
    assert q.nbytes == rows * cols + 4
    # both layouts: the data of each, the shared scale once
    q = build("tensorwise", (rows, cols))
    assert q.scale_inv_t is q.scale_inv
    assert q.nbytes == 2 * rows * cols + 4
    # 1x128 tiles: FP32 scales [R, ceil(K/128)] and [K, ceil(R/128)]
    q = build("block-1x128", (rows, cols))
    assert q.nbytes == 2 * rows * cols + 4 * (rows * 2 + cols * 1)
    # 128x128 tiles: one tile row, two tile columns, in each layout
    q = build("block-128x128", (rows, cols))
    assert q.nbytes == 2 * rows * cols + 4 * (2 + 2)
    # MXFP8: one E8M0 byte per 32 elements, in each layout
    q = build("mxfp8", (rows, cols))
    assert q.nbytes == 2 * rows * cols + 2 * rows * cols // 32
    # NVFP4: half a byte per element, one E4M3 byte per 16, one FP32 global scale
    q = build("nvfp4", (rows, cols))
    assert q.nbytes == 2 * rows * cols // 2 + 2 * rows * cols // 16 + 4
    q = build("nvfp4-2d", (rows, cols))
    assert q.nbytes == 2 * rows * cols // 2 + 2 * (rows // 16) * (cols // 16) + 4


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logical_shape_and_dtype(name, dtype):
    shape = (2, 32, 64)
    q = build(name, shape, dtype)
    assert q.shape == torch.Size(shape) and isinstance(q.shape, torch.Size)
    assert q.dtype == dtype
    assert q.device == torch.device("cpu")
    deq = q.dequantize()
    assert deq.shape == shape and deq.dtype == dtype
    assert q.dequantize(torch.float32).dtype == torch.float32
    if isinstance(q, NVFP4Tensor):  # two E2M1 codes per byte
        assert q.data.dtype == torch.uint8 and q.data.shape == (2, 32, 32)
        assert q.data_t.shape == (64, 32)


def test_construction_needs_some_data():
    with pytest.raises(ValueError, match="row-wise or column-wise"):
        Float8Tensor(fmt="e4m3", shape=(2, 2), dtype=torch.float32)


# -- transposition and column-wise operands --------------------------------------------------
@pytest.mark.parametrize("name", ["tensorwise", "block-1x128", "block-128x128", "mxfp8", "nvfp4"])
def test_t_swaps_the_layouts(name):
    q = build(name, (64, 160))
    qt = q.t()
    assert type(qt) is type(q)
    assert qt.shape == (160, 64) and qt.dtype == q.dtype and qt.fmt == q.fmt
    assert qt.data is q.data_t and qt.data_t is q.data
    assert qt.scale_inv is q.scale_inv_t and qt.scale_inv_t is q.scale_inv
    assert qt.block == q.block_t and qt.block_t == q.block
    # the original is untouched
    assert q.shape == (64, 160) and q.data.shape[0] == 64
    # dequantizing the transpose decodes the column-wise layout
    only_t = QuantizedTensor.__tensor_unflatten__(
        {"data_t": q.data_t, "scale_inv_t": q.scale_inv_t, **_extra(q)},
        q.__tensor_flatten__()[1],
    )
    assert same(qt.dequantize(), only_t.dequantize().t())
    # and twice is the original
    qtt = qt.t()
    assert qtt.shape == q.shape and qtt.data is q.data and qtt.data_t is q.data_t
    assert same(qtt.dequantize(), q.dequantize())
    if name == "tensorwise":  # per-tensor scaling transposes exactly
        assert same(qt.dequantize(), q.dequantize().t())


def _extra(q):
    return {"global_scale_inv": q.global_scale_inv} if isinstance(q, NVFP4Tensor) else {}


def test_t_needs_columnwise_data_and_two_dims():
    q = build("tensorwise-rowwise-only")
    with pytest.raises(ValueError, match="column-wise.*columnwise=True"):
        q.t()
    with pytest.raises(ValueError, match="column-wise"):
        q.columnwise_operand()
    q3 = build("tensorwise", (2, 8, 16))
    with pytest.raises(ValueError, match="2D"):
        q3.t()


@pytest.mark.parametrize("name", ["tensorwise", "block-1x128", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape", [(64, 160), (2, 32, 160)])
def test_columnwise_operand_drops_the_rowwise_bytes(name, shape):
    q = build(name, shape)
    rows = math.prod(shape[:-1])
    op = q.columnwise_operand()
    assert type(op) is type(q)
    assert op.shape == (shape[-1], rows)
    assert op.data is q.data_t and op.scale_inv is q.scale_inv_t and op.block == q.block_t
    assert op.data_t is None and op.scale_inv_t is None and not op.has_columnwise
    rowwise_bytes = q.data.numel() * q.data.element_size()
    if q.scale_inv is not q.scale_inv_t:
        rowwise_bytes += q.scale_inv.numel() * q.scale_inv.element_size()
    assert op.nbytes == q.nbytes - rowwise_bytes
    # the same values as the column-wise layout of the original
    assert same(op.dequantize(), op.dequantize_rowwise_2d())
    only_t = QuantizedTensor.__tensor_unflatten__(
        {"data_t": q.data_t, "scale_inv_t": q.scale_inv_t, **_extra(q)},
        q.__tensor_flatten__()[1],
    )
    assert same(op.dequantize(), only_t.dequantize().reshape(rows, -1).t())


@pytest.mark.parametrize("shape", [(48, 96), (3, 16, 96), (96,)])
def test_dequantize_from_columnwise_only(shape):
    x = sample(shape, torch.bfloat16, seed=5)
    both = CurrentScalingQuantizer().quantize(x, columnwise=True)
    only_t = CurrentScalingQuantizer().quantize(x, rowwise=False, columnwise=True)
    assert not only_t.has_rowwise and only_t.has_columnwise
    assert same(only_t.dequantize(), both.dequantize())
    # 1x128 tiles: the column-wise layout is quantized along the other axis; decode it
    # independently of dequantize() (one scale per 128 consecutive rows of each column)
    if len(shape) > 1:
        q = BlockScalingQuantizer(block_dim=1).quantize(x, rowwise=False, columnwise=True)
        rows = x.numel() // shape[-1]
        data_t = q.data_t.double()  # [K, R]
        scales = q.scale_inv_t.double().repeat_interleave(128, dim=1)[:, :rows]
        expected = (data_t * scales).t().reshape(shape)
        got = q.dequantize(torch.float32).double()
        assert got.shape == shape
        assert torch.allclose(got, expected, rtol=2.0**-23, atol=0)
    with pytest.raises(ValueError, match="row-wise"):
        only_t.dequantize_rowwise_2d()


def test_dequantize_empty_rows():
    # an empty batch: zero rows, in every row-wise layout and the per-tensor transpose
    quantizers = (
        FixedScaleQuantizer(torch.tensor(2.0), "e4m3"),
        BlockScalingQuantizer(block_dim=1),
        BlockScalingQuantizer(block_dim=2),
        MXFP8Quantizer(),
        NVFP4Quantizer(),
    )
    for quantizer in quantizers:
        for shape in [(0, 32), (2, 0, 32)]:
            q = quantizer.quantize(torch.empty(shape))
            assert q.dequantize().shape == shape
    q = FixedScaleQuantizer(torch.tensor(2.0), "e4m3").quantize(torch.empty(0, 32), columnwise=True)
    assert q.columnwise_operand().dequantize().shape == (32, 0)


# Empty layouts whose dequantize() fails; the id names the failing line.
EMPTY = {
    # _rows_cols: data.numel() // shape[-1] with shape[-1] == 0
    "rows_cols-fixed-1d-K0": (lambda: FixedScaleQuantizer(torch.tensor(2.0), "e4m3"), (0,), False),
    "rows_cols-fixed-3d-K0": (
        lambda: FixedScaleQuantizer(torch.tensor(2.0), "e4m3"),
        (2, 3, 0),
        False,
    ),
    "rows_cols-nvfp4-K0": (lambda: NVFP4Quantizer(), (3, 0), False),
    "rows_cols-nvfp4-columnwise-R0": (lambda: NVFP4Quantizer(), (0, 32), True),
    # apply_scales: scales.reshape(-1, 0) of empty block scales is ambiguous
    "apply_scales-block-1x128-K0": (lambda: BlockScalingQuantizer(block_dim=1), (3, 0), False),
    "apply_scales-block-columnwise-R0": (lambda: BlockScalingQuantizer(), (0, 32), True),
    "apply_scales-mxfp8-K0": (lambda: MXFP8Quantizer(), (3, 0), False),
    "apply_scales-mxfp8-columnwise-R0": (lambda: MXFP8Quantizer(), (0, 32), True),
}


@pytest.mark.parametrize("case", sorted(EMPTY))
def test_dequantize_empty_layouts(case):
    make, shape, columnwise = EMPTY[case]
    q = make().quantize(torch.empty(shape), rowwise=not columnwise, columnwise=columnwise)
    assert q.dequantize().shape == shape
    if columnwise:
        assert q.columnwise_operand().dequantize().shape == (shape[-1], 0)


def test_repr():
    q = build("tensorwise", (4, 32))
    text = repr(q)
    assert text.startswith("Float8Tensor(")
    assert "(4, 32)" in text and "e4m3" in text and "rowwise+columnwise" in text
    text = repr(build("tensorwise-columnwise-only", (4, 32)))
    assert "columnwise" in text and "rowwise+" not in text
    text = repr(build("tensorwise-rowwise-only", (4, 32)))
    assert "e5m2" in text and "columnwise" not in text
    text = repr(build("nvfp4", (32, 64)))
    assert text.startswith("NVFP4Tensor(") and "(32, 64)" in text and "e2m1" in text
    text = repr(build("mxfp8", (32, 64)))
    assert text.startswith("MXFP8Tensor(") and "(32, 64)" in text and "(1, 32)" in text
