"""The native CUDA quantize kernels (``csrc/cuda/``) against the CPU operators, bit for
bit: run on a machine with a GPU and nvcc (``pytest -m gpu tests/cuda/test_native_cuda.py``);
skipped elsewhere.

Both sides are called through the same entry point (``build.entry_points()``), which
the dispatcher routes by the device of its tensors: a CUDA tensor reaches the CUDA
kernel, its CPU copy the CPU operator, whose values the CPU tests check against the
PyTorch reference. Codes are compared as bytes and scales as FP32 bits, over every BF16
and FP16 bit pattern, random FP32 with outliers and subnormals, infinities and NaN,
unaligned and empty shapes, both layouts and both FP8 formats. The kernels must also
launch without a host sync: under ``torch.cuda.set_sync_debug_mode("error")`` and
inside a CUDA graph capture, which any synchronising call breaks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fastcast.kernels import build, choice

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NATIVE = (
    "quantize_tensorwise",
    "record_amax",
    "quantize_recording",
    "quantize_rows",
    "quantize_blocks",
    "quantize_mxfp8",
)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SHAPES = ((1, 1), (33, 130), (0, 16), (16, 0), (7,), (3, 5, 7), (130, 33), (257, 1024))


@pytest.fixture(scope="module")
def ops():
    """The entry points, with the CUDA library built and loaded (a failure to build on
    a GPU machine is a failure here, not a skip)."""
    build.load_cuda()
    missing = set(NATIVE) - set(build.cuda_ops())
    assert not missing, f"no CUDA kernel registered for {sorted(missing)}"
    return build.entry_points()


def bits(t: torch.Tensor) -> torch.Tensor:
    """t on the CPU as integers of its width: FP8 as bytes, FP32 as int32."""
    t = t.detach().cpu()
    if t.dtype in FP8:
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.is_cuda, what
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    assert got.is_contiguous() == want.is_contiguous(), what
    g, w = bits(got).reshape(-1), bits(want).reshape(-1)
    if not torch.equal(g, w):
        bad = (g != w).nonzero().reshape(-1)
        i = bad[0].item()
        raise AssertionError(
            f"{what}: {bad.numel()} of {g.numel()} differ; first at flat index {i}: "
            f"cuda {g[i].item():#x} cpu {w[i].item():#x}"
        )


# ---- inputs ---------------------------------------------------------------------------


def every_16_bit(dtype: torch.dtype, finite_only: bool) -> torch.Tensor:
    """Every bit pattern of a 16-bit float type (256 x 256), or only its finite values."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    if finite_only:
        x = x[torch.isfinite(x)]
        x = x[: x.numel() // 256 * 256]
    return x.reshape(256, -1)


def random_fp32(n: int, seed: int) -> torch.Tensor:
    """Normal values over a wide range of exponents, with outliers, subnormals and zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randn(n, generator=g) * 12)
    if n >= 24:  # a few elements replaced: extremes of FP32 and of both formats
        picks = torch.randperm(n, generator=g)[:24]
        x[picks[:16]] = torch.tensor(
            [3.0e38, -3.4e38, 1e-45, -1e-40, 0.0, -0.0, 448.0, 57344.0] * 2
        )
        x[picks[16:]] *= 1e30
    return x


def with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    y = x.clone().view(-1)
    if y.numel() >= 4:
        y[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan")])
    return y.view(x.shape)


def cases() -> list[tuple[str, torch.Tensor]]:
    """Named CPU inputs; each test copies them to the GPU."""
    out = [
        ("bf16 all", every_16_bit(torch.bfloat16, False)),
        ("bf16 finite", every_16_bit(torch.bfloat16, True)),
        ("fp16 all", every_16_bit(torch.float16, False)),
        ("fp16 finite", every_16_bit(torch.float16, True)),
        ("fp32 random", random_fp32(1 << 20, 0).reshape(1024, 1024)),
        ("fp32 tiny", random_fp32(4096, 1).reshape(64, 64) * 1e-38),
        ("fp32 inf nan", with_nonfinite(random_fp32(4096, 2).reshape(64, 64))),
        ("fp32 zeros", torch.zeros(5, 40)),
    ]
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            n = 1
            for d in shape:
                n *= d
            out.append((f"{dtype} {shape}", random_fp32(n, 10 + i).to(dtype).reshape(shape)))
    # Contiguous but not 16-byte aligned: the kernels' scalar paths.
    base = random_fp32(33 * 130 + 1, 3)
    out.append(("fp32 unaligned", base[1:].reshape(33, 130)))
    out.append(("bf16 unaligned", base.to(torch.bfloat16)[1:].reshape(33, 130)))
    out.append(("fp16 unaligned odd", base.to(torch.float16)[3 : 3 + 7 * 611].reshape(-1, 7)))
    return out


CASES = cases()
IDS = [name for name, _ in CASES]
INPUTS = [x for _, x in CASES]


def on_gpu(x: torch.Tensor) -> torch.Tensor:
    """The same values on the GPU, at the same storage offset (so alignment carries)."""
    if x.storage_offset() == 0:
        return x.cuda()
    whole = x.new_empty(0).set_(x.untyped_storage()).cuda()  # the whole storage, 1-D
    return whole.as_strided(x.shape, x.stride(), x.storage_offset())


# ---- quantize_tensorwise ---------------------------------------------------------------


@pytest.mark.parametrize("x", INPUTS, ids=IDS)
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_current_scaling_matches_the_cpu(ops, x, dtype):
    op = ops["quantize_tensorwise"]
    gx = on_gpu(x)
    for rowwise, columnwise in ((True, False), (True, True), (False, True)):
        for power_2, epsilon in ((False, 0.0), (True, 0.0), (False, 1e-3)):
            what = f"rowwise={rowwise} columnwise={columnwise} power_2={power_2} eps={epsilon}"
            want = op(x, None, dtype, power_2, epsilon, rowwise, columnwise)
            got = op(gx, None, dtype, power_2, epsilon, rowwise, columnwise)
            for name, g, w in zip(("data", "scale_inv", "data_t"), got, want, strict=True):
                assert_same(g, w, f"{name} {what}")


@pytest.mark.parametrize("x", INPUTS, ids=IDS)
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_given_scale_matches_the_cpu(ops, x, dtype):
    op = ops["quantize_tensorwise"]
    gx = on_gpu(x)
    for value, shape in ((0.37, ()), (1e30, (1,)), (2.0**-20, (1,))):
        scale = torch.full(shape, value)
        for rowwise, columnwise in ((True, False), (True, True), (False, True), (False, False)):
            what = f"scale={value} rowwise={rowwise} columnwise={columnwise}"
            want = op(x, scale, dtype, False, 0.0, rowwise, columnwise)
            got = op(gx, scale.cuda(), dtype, False, 0.0, rowwise, columnwise)
            for name, g, w in zip(("data", "scale_inv", "data_t"), got, want, strict=True):
                assert_same(g, w, f"{name} {what}")


def test_a_scale_view_into_a_slab_is_read_in_place(ops):
    """Delayed scaling's scales are one-element views into a [N] tensor."""
    x = random_fp32(4096, 5).reshape(64, 64)
    slab = torch.tensor([0.5, 3.0, 7.0])
    want = ops["quantize_tensorwise"](x, slab[1:2], torch.float8_e4m3fn, False, 0.0, True, True)
    got = ops["quantize_tensorwise"](
        x.cuda(), slab.cuda()[1:2], torch.float8_e4m3fn, False, 0.0, True, True
    )
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, "slab view")


# ---- record_amax, quantize_recording ---------------------------------------------------


@pytest.mark.parametrize("x", INPUTS, ids=IDS)
def test_record_amax_matches_the_cpu(ops, x):
    gx = on_gpu(x)
    for start in (0.0, 0.5, 1e30, float("nan")):
        slot, gslot = torch.full((1,), start), torch.full((1,), start, device="cuda")
        ops["record_amax"](slot, x)
        ops["record_amax"](gslot, gx)
        assert_same(gslot, slot, f"slot from {start}")


@pytest.mark.parametrize("x", INPUTS, ids=IDS)
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_quantize_recording_matches_the_cpu(ops, x, dtype):
    gx = on_gpu(x)
    for value, start in ((0.37, 0.0), (1e30, 2.0), (2.0**-20, float("inf"))):
        scale, slot = torch.full((1,), value), torch.full((1,), start)
        gscale, gslot = scale.cuda(), slot.cuda()
        want = ops["quantize_recording"](x, scale, slot, dtype)
        got = ops["quantize_recording"](gx, gscale, gslot, dtype)
        for name, g, w in zip(("data", "scale_inv"), got, want, strict=True):
            assert_same(g, w, f"{name} scale={value}")
        assert_same(gslot, slot, f"slot scale={value} from {start}")
        assert_same(gscale, scale, "the scale is not written")


# ---- quantize_rows, quantize_blocks, quantize_mxfp8 ------------------------------------

MATRICES = [(name, x) for name, x in CASES if x.dim() == 2]
MATRIX_IDS = [name for name, _ in MATRICES]
MATRIX_INPUTS = [x for _, x in MATRICES]


@pytest.mark.parametrize("x", MATRIX_INPUTS, ids=MATRIX_IDS)
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_rows_match_the_cpu(ops, x, dtype):
    gx = on_gpu(x)
    for power_2, columns in itertools.product((False, True), (False, True)):
        want = ops["quantize_rows"](x, dtype, power_2, columns)
        got = ops["quantize_rows"](gx, dtype, power_2, columns)
        for name, g, w in zip(("data", "scale_inv"), got, want, strict=True):
            assert_same(g, w, f"{name} power_2={power_2} columns={columns}")


@pytest.mark.parametrize("x", MATRIX_INPUTS, ids=MATRIX_IDS)
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_blocks_match_the_cpu(ops, x, dtype):
    gx = on_gpu(x)
    for tile_rows, power_2, epsilon in itertools.product((1, 128), (False, True), (0.0, 1e-3)):
        what = f"tile_rows={tile_rows} power_2={power_2} eps={epsilon}"
        want = ops["quantize_blocks"](x, tile_rows, dtype, power_2, epsilon)
        got = ops["quantize_blocks"](gx, tile_rows, dtype, power_2, epsilon)
        for name, g, w in zip(("data", "scale_inv"), got, want, strict=True):
            assert_same(g, w, f"{name} {what}")
    # The column-wise layouts quantize the transposed view (read in place on the CPU).
    want = ops["quantize_blocks"](x.t(), 128, dtype, False, 0.0)
    got = ops["quantize_blocks"](gx.t(), 128, dtype, False, 0.0)
    for name, g, w in zip(("data", "scale_inv"), got, want, strict=True):
        assert_same(g, w, f"{name} transposed")


def mx_inputs() -> list[tuple[str, torch.Tensor]]:
    out = [(name, x) for name, x in MATRICES if x.shape[1] % 32 == 0]
    out.append(("fp32 96 cols", random_fp32(7 * 96, 8).reshape(7, 96)))
    out.append(("bf16 nonfinite 64", with_nonfinite(random_fp32(64 * 64, 9).reshape(64, 64))))
    base = random_fp32(33 * 64 + 1, 4)
    out.append(("fp32 unaligned 64", base[1:].reshape(33, 64)))
    return out


MX = mx_inputs()


@pytest.mark.parametrize("x", [x for _, x in MX], ids=[name for name, _ in MX])
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_mxfp8_matches_the_cpu(ops, x, dtype):
    gx = on_gpu(x)
    for ocp in (False, True):
        want = ops["quantize_mxfp8"](x, dtype, ocp)
        got = ops["quantize_mxfp8"](gx, dtype, ocp)
        for name, g, w in zip(("data", "e8m0"), got, want, strict=True):
            assert_same(g, w, f"{name} ocp={ocp}")


# ---- how they launch -------------------------------------------------------------------


def _launch_all(ops, x, scale, slot):
    ops["quantize_tensorwise"](x, None, torch.float8_e4m3fn, False, 0.0, True, True)
    ops["quantize_tensorwise"](x, None, torch.float8_e5m2, True, 0.0, True, False)
    ops["quantize_tensorwise"](x, scale, torch.float8_e4m3fn, False, 0.0, True, False)
    ops["record_amax"](slot, x)
    ops["quantize_rows"](x, torch.float8_e4m3fn, False, True)
    ops["quantize_rows"](x, torch.float8_e4m3fn, True, False)
    ops["quantize_blocks"](x, 1, torch.float8_e4m3fn, False, 0.0)
    ops["quantize_blocks"](x, 128, torch.float8_e4m3fn, True, 0.0)
    ops["quantize_mxfp8"](x, torch.float8_e4m3fn, False)
    return ops["quantize_recording"](x, scale, slot, torch.float8_e4m3fn)


def test_no_host_sync(ops):
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    scale = torch.ones(1, device="cuda")
    slot = torch.zeros(1, device="cuda")
    _launch_all(ops, x, scale, slot)  # first calls (lazy initialisation) outside the check
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _launch_all(ops, x, scale, slot)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def test_capturable_in_a_cuda_graph(ops):
    """A capture fails on any synchronising call or host read; the replay must give what
    an eager call gives."""
    x = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    scale = torch.full((1,), 3.0, device="cuda")
    slot = torch.zeros(1, device="cuda")
    eager = _launch_all(ops, x, scale, slot)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _launch_all(ops, x, scale, slot)  # warm-up on the side stream, as torch advises
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _launch_all(ops, x, scale, slot)
    slot.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for g, e in zip(captured, eager, strict=True):
        assert torch.equal(bits(g), bits(e))
    assert slot.item() == x.float().abs().max().item()


def test_the_current_stream_is_used(ops):
    """Launched on torch's current stream: work queued there is ordered before them."""
    x = torch.randn(2048, 2048, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = x * 2  # queued on `stream`; the quantize must see its result
        data, scale_inv, _ = ops["quantize_tensorwise"](
            y, None, torch.float8_e4m3fn, False, 0.0, True, False
        )
    stream.synchronize()
    want = ops["quantize_tensorwise"](y.cpu(), None, torch.float8_e4m3fn, False, 0.0, True, False)
    assert_same(data, want[0], "data")
    assert_same(scale_inv, want[1], "scale_inv")


def test_auto_mode_routes_cuda_tensors_to_the_native_kernels(ops, monkeypatch):
    monkeypatch.delenv("FASTCAST_KERNELS", raising=False)
    choice.refresh()
    try:
        x = torch.empty(4, 4, device="cuda")
        for name in NATIVE:
            assert choice.fused_op(name, x) is ops[name], name
        monkeypatch.setenv("FASTCAST_KERNELS", "compiled")
        choice.refresh()
        for name in NATIVE:  # Inductor's forms, which a GPU run compares the kernels with
            assert choice.fused_op(name, x) is not ops[name], name
    finally:
        monkeypatch.delenv("FASTCAST_KERNELS", raising=False)
        choice.refresh()


@pytest.mark.parametrize(
    ("rows", "cols", "dtype"),
    list(itertools.product((1, 4096), (4096, 8192), (torch.bfloat16, torch.float32))),
)
def test_large_tensors_match_the_cpu(ops, rows, cols, dtype):
    """Grids that loop (more work than blocks): the grid-stride paths."""
    x = random_fp32(rows * cols, rows + cols).to(dtype).reshape(rows, cols)
    want = ops["quantize_tensorwise"](x, None, torch.float8_e4m3fn, False, 0.0, True, True)
    got = ops["quantize_tensorwise"](x.cuda(), None, torch.float8_e4m3fn, False, 0.0, True, True)
    for name, g, w in zip(("data", "scale_inv", "data_t"), got, want, strict=True):
        assert_same(g, w, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(256, 512), (3, 40, 72), (33, 130)], ids=str)
def test_per_tensor_quantizers_take_both_layouts_from_the_kernel(ops, shape, dtype):
    """fc.quantize on CUDA takes the column-wise codes from the kernel's tiled pass (no
    transposing copy of the codes afterwards), equal to the CPU's, under current scaling
    and with a given (delayed-style) scale."""
    import fastcast as fc  # noqa: PLC0415
    from fastcast.quantizers.tensorwise import quantize_with_scale  # noqa: PLC0415

    torch.manual_seed(0)
    x = (torch.randn(shape) * 7).to(dtype)
    scale = torch.tensor([3.5])
    pairs = [
        (
            fc.quantize(x, fc.Float8CurrentScaling(), "input", columnwise=True),
            fc.quantize(x.cuda(), fc.Float8CurrentScaling(), "input", columnwise=True),
        ),
        (
            quantize_with_scale(x, scale, "e4m3", True, True),
            quantize_with_scale(x.cuda(), scale.cuda(), "e4m3", True, True),
        ),
    ]
    for want, got in pairs:
        assert got.data_t.is_contiguous()
        assert_same(got.data_t, want.data_t.contiguous(), "data_t")
        assert_same(got.data, want.data, "data")
        assert_same(got.scale_inv_t, want.scale_inv_t, "scale_inv_t")
    only_columns = fc.quantize(
        x.cuda(), fc.Float8CurrentScaling(), "input", rowwise=False, columnwise=True
    )
    assert only_columns.data is None
    assert_same(only_columns.data_t, pairs[0][0].data_t.contiguous(), "columns only")


def test_delayed_quantizer_records_and_writes_both_layouts(ops):
    """Delayed scaling's quantizer on CUDA asked for both layouts (its amax pass, then the
    tiled cast) records the amax and writes the codes the CPU does."""
    from types import SimpleNamespace  # noqa: PLC0415

    from fastcast.quantizers.tensorwise import DelayedScalingQuantizer  # noqa: PLC0415

    torch.manual_seed(1)
    x = (torch.randn(96, 160) * 5).bfloat16()
    results = []
    for device in ("cpu", "cuda"):
        meta = SimpleNamespace(
            scale_views=[torch.full((1,), 2.5, device=device)],
            amax_slots=[torch.full((1,), 1.0, device=device)],
        )
        q = DelayedScalingQuantizer(meta, 0).quantize(x.to(device), columnwise=True)
        results.append((q, meta.amax_slots[0]))
    (want, want_slot), (got, got_slot) = results
    assert_same(got.data, want.data, "data")
    assert_same(got.data_t, want.data_t.contiguous(), "data_t")
    assert_same(got.scale_inv, want.scale_inv, "scale_inv")
    assert_same(got_slot, want_slot, "recorded amax")
