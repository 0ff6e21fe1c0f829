"""fc.TensorProto: a data-free, hashable prototype that rebuilds quantized tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fastcast as fc

RECIPES = {
    "current": fc.Float8CurrentScaling(),
    "block": fc.Float8BlockScaling(),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(),
    "rowwise": fc.Float8RowwiseScaling(),
}


def _quantized(name: str, seed: int = 0, columnwise: bool = True):
    torch.manual_seed(seed)
    return fc.quantize(torch.randn(64, 96), RECIPES[name], columnwise=columnwise)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_prototype_holds_no_data_and_is_a_value(name):
    q = _quantized(name)
    proto = fc.TensorProto.of(q)
    fields = [getattr(proto, f.name) for f in dataclasses.fields(proto)]
    flat = [x for f in fields for x in (f if isinstance(f, tuple) else (f,))]
    assert not any(isinstance(x, torch.Tensor) for x in flat)
    # Another quantization of different data with the same layout: an equal prototype.
    other = fc.TensorProto.of(_quantized(name, seed=1))
    assert proto == other and hash(proto) == hash(other)
    assert proto != fc.TensorProto.of(_quantized(name, columnwise=False))
    assert proto.shape == (64, 96) and proto.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_build_from_the_inner_tensors_gives_the_same_tensor(name):
    q = _quantized(name)
    proto = fc.TensorProto.of(q)
    names, _ = q.__tensor_flatten__()
    rebuilt = proto.build({n: getattr(q, n) for n in names})
    assert type(rebuilt) is type(q)
    assert torch.equal(rebuilt.dequantize(), q.dequantize())
    assert torch.equal(rebuilt.t().dequantize(), q.t().dequantize())


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_empty_allocates_exactly_the_layout(name):
    q = _quantized(name)
    proto = fc.TensorProto.of(q)
    fresh = proto.empty("cpu")
    assert type(fresh) is type(q)
    assert fc.TensorProto.of(fresh) == proto
    for inner_name, shape, dtype in proto.inner:
        t = getattr(fresh, inner_name)
        assert tuple(t.shape) == shape and t.dtype == dtype
    assert proto.nbytes >= q.nbytes  # a shared per-tensor scale is counted per layout


def test_build_names_what_does_not_fit():
    q = _quantized("mxfp8")
    proto = fc.TensorProto.of(q)
    names, _ = q.__tensor_flatten__()
    inner = {n: getattr(q, n) for n in names}
    with pytest.raises(ValueError, match="expected inner tensors"):
        proto.build({k: v for k, v in inner.items() if k != "data"})
    bad = dict(inner, data=inner["data"].float())
    with pytest.raises(ValueError, match="data must be torch.float8_e4m3fn"):
        proto.build(bad)
    with pytest.raises(ValueError, match="no quantized storage"):
        dataclasses.replace(proto, storage="nope").build(inner)


def test_plain_tensors_have_prototypes_too():
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    proto = fc.TensorProto.of(x)
    assert proto.storage == "tensor" and proto.nbytes == 30
    y = proto.empty()
    assert y.shape == x.shape and y.dtype == x.dtype
    with pytest.raises(TypeError, match="TensorProto.of"):
        fc.TensorProto.of([1, 2])
