"""The native CUDA kernels of NVFP4, dequantization and delayed scaling's update
(``csrc/cuda/nvfp4.cu``, ``dequantize.cu``, ``delayed.cu``) against the CPU operators, bit
for bit: run on a machine with a GPU and nvcc (``pytest -m gpu``); skipped elsewhere.

As ``test_native_cuda.py``: one entry point for both sides (the dispatcher routes by
device), codes and E4M3 scales compared as bytes, FP32 as bits. Stochastic rounding
takes the caller's draws on both devices (``NVFP4Quantizer._draws``: ``torch.rand`` on
the tensor's device), so the same draws, copied to the GPU, must give the same codes;
the CUDA generator's own draws are checked for reproducibility under
``torch.manual_seed`` and for unbiasedness. Dequantized values are compared as values
with every NaN equal: a GPU multiply returns its canonical NaN, not the CPU's payload.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from test_native_cuda import (
    assert_same,
    bits,
    every_16_bit,
    on_gpu,
    random_fp32,
    with_nonfinite,
)

from fastcast.kernels import build, choice
from fastcast.quantizers.nvfp4 import NVFP4Quantizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NATIVE = ("quantize_nvfp4", "dequantize_nvfp4", "dequantize_blocks", "delayed_update")
LAYOUTS = ((True, False), (False, True), (True, True))  # (rowwise, columnwise)
FIELDS = ("data", "scale_inv", "data_t", "scale_inv_t", "global_scale_inv")


@pytest.fixture(scope="module")
def ops():
    build.load_cuda()
    missing = set(NATIVE) - set(build.cuda_ops())
    assert not missing, f"no CUDA kernel registered for {sorted(missing)}"
    return build.entry_points()


# ---- quantize_nvfp4 --------------------------------------------------------------------


def finite_16_bit(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit type, as many as fill [16 k, 256]."""
    x = every_16_bit(dtype, finite_only=True).reshape(-1)
    return x[: x.numel() // 4096 * 4096].reshape(-1, 256)


def nvfp4_cases() -> list[tuple[str, torch.Tensor]]:
    out = [
        ("bf16 all", every_16_bit(torch.bfloat16, False)),
        ("bf16 finite", finite_16_bit(torch.bfloat16)),
        ("fp16 all", every_16_bit(torch.float16, False)),
        ("fp16 finite", finite_16_bit(torch.float16)),
        ("fp32 random", random_fp32(1 << 20, 0).reshape(1024, 1024)),
        ("fp32 tiny", random_fp32(4096, 1).reshape(64, 64) * 1e-38),
        ("fp32 inf nan", with_nonfinite(random_fp32(4096, 2).reshape(64, 64))),
        ("fp32 zeros", torch.zeros(16, 48)),
        ("fp32 all inf", torch.full((16, 32), float("inf"))),
        ("fp32 subnormal amax", torch.full((16, 32), 1e-40)),
    ]
    shapes = ((16, 16), (32, 64), (3, 16, 32), (48, 160), (32,), (5, 48), (0, 16), (16, 0))
    for i, shape in enumerate(shapes):
        for dtype in (torch.float32, torch.bfloat16):
            n = 1
            for d in shape:
                n *= d
            x = random_fp32(n, 20 + i).to(dtype).reshape(shape)
            if x.dim() == 2 and x.shape[0] > 1:  # rows of very different magnitudes
                x = x * (10.0 ** torch.linspace(-4, 4, x.shape[0]))[:, None].to(dtype)
            out.append((f"{dtype} {shape}", x))
    # Contiguous but not 16-byte aligned: the kernel's scalar loads.
    base = random_fp32(48 * 160 + 1, 3)
    out.append(("fp32 unaligned", base[1:].reshape(48, 160)))
    out.append(("bf16 unaligned", base.to(torch.bfloat16)[1:].reshape(48, 160)))
    nonfinite = with_nonfinite(random_fp32(2048, 4).reshape(32, 64))
    out.append(("bf16 nonfinite", nonfinite.bfloat16()))
    out.append(("fp16 nonfinite", nonfinite.half()))
    return out


NVFP4_CASES = nvfp4_cases()


def draws_for(x: torch.Tensor, seed: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU draws laid out like x viewed as [R, K], and [K, R]; `offset` > 0 makes the
    GPU copies start off a 16-byte boundary (the kernel's scalar draw loads)."""
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    g = torch.Generator().manual_seed(seed)
    rand = torch.rand(rows * cols + offset, generator=g)[offset:].reshape(rows, cols)
    rand_t = torch.rand(rows * cols + offset, generator=g)[offset:].reshape(cols, rows)
    return rand, rand_t


def compare_nvfp4(op, x: torch.Tensor, block_2d: bool, stochastic: bool, offset: int = 0):
    gx = on_gpu(x)
    rand, rand_t = draws_for(x, 7, offset) if stochastic else (None, None)
    g_rand = on_gpu(rand) if stochastic else None
    g_rand_t = on_gpu(rand_t) if stochastic else None
    for rowwise, columnwise in LAYOUTS:
        args = (block_2d, rowwise, columnwise, stochastic)
        what = f"block_2d={block_2d} rowwise={rowwise} columnwise={columnwise} sr={stochastic}"
        try:
            want = op(x, *args, rand, rand_t)
        except RuntimeError as error:  # a shape the CPU refuses: so must the GPU
            with pytest.raises(RuntimeError, match=re.escape(str(error).splitlines()[0][-40:])):
                op(gx, *args, g_rand, g_rand_t)
            continue
        got = op(gx, *args, g_rand, g_rand_t)
        for name, g, w in zip(FIELDS, got, want, strict=True):
            assert_same(g, w, f"{name} {what}")


@pytest.mark.parametrize("x", [x for _, x in NVFP4_CASES], ids=[n for n, _ in NVFP4_CASES])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_nvfp4_matches_the_cpu(ops, x, block_2d):
    compare_nvfp4(ops["quantize_nvfp4"], x, block_2d, stochastic=False)


@pytest.mark.parametrize("x", [x for _, x in NVFP4_CASES], ids=[n for n, _ in NVFP4_CASES])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_nvfp4_stochastic_matches_the_cpu_on_the_same_draws(ops, x, block_2d):
    compare_nvfp4(ops["quantize_nvfp4"], x, block_2d, stochastic=True)
    if x.numel() and x.numel() <= 1 << 16:
        compare_nvfp4(ops["quantize_nvfp4"], x, block_2d, stochastic=True, offset=1)


def test_nvfp4_large_grids_match_the_cpu(ops):
    """More tiles than the grid has threads for: the grid-stride loop."""
    for rows, cols in ((4096, 4096), (16, 65536 * 2)):
        x = random_fp32(rows * cols, rows + cols).bfloat16().reshape(rows, cols)
        for block_2d in (False, True):
            want = ops["quantize_nvfp4"](x, block_2d, True, True, False, None, None)
            got = ops["quantize_nvfp4"](x.cuda(), block_2d, True, True, False, None, None)
            for name, g, w in zip(FIELDS, got, want, strict=True):
                assert_same(g, w, f"{name} {rows}x{cols} block_2d={block_2d}")


def test_nvfp4_stochastic_rounding_uses_the_cuda_generator(ops):
    """Through the quantizer: torch.manual_seed fixes the codes; another seed moves
    some; and the rounding is unbiased (the mean of many roundings tends to x)."""
    x = torch.randn(64, 256, device="cuda") * 3
    quantizer = NVFP4Quantizer(stochastic_rounding=True)

    def codes(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return quantizer.quantize(x, rowwise=True, columnwise=True).data

    assert torch.equal(codes(11), codes(11))
    assert not torch.equal(codes(11), codes(12))
    torch.manual_seed(13)
    total = torch.zeros_like(x)
    n = 256
    for _ in range(n):
        total += quantizer.quantize(x).dequantize(torch.float32)
    nearest = NVFP4Quantizer().quantize(x).dequantize(torch.float32)
    bias = (total / n - x).abs().mean().item()
    # Rounding to nearest errs by ~1/4 step on average; the mean of n stochastic
    # roundings by ~step / sqrt(n): 16 times less here (allow 4 times less).
    assert bias < (nearest - x).abs().mean().item() / 4


# ---- dequantize_nvfp4, dequantize_blocks -----------------------------------------------


def values_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """FP32 values equal bit for bit, except that any NaN equals any NaN."""
    assert got.is_cuda and got.shape == want.shape and got.dtype == want.dtype, what
    g, w = got.cpu().reshape(-1), want.reshape(-1)
    same = (g.view(torch.int32) == w.view(torch.int32)) | (g.isnan() & w.isnan())
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(f"{what}: {(~same).sum()} differ; first at {i}: {g[i]} vs {w[i]}")


@pytest.mark.parametrize("block_rows", [1, 16])
def test_dequantize_nvfp4_matches_the_cpu(ops, block_rows):
    op = ops["dequantize_nvfp4"]
    g = torch.Generator().manual_seed(5)
    rows, cols = 256, 512
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    packed[0, :128] = torch.arange(128, dtype=torch.uint8) * 2  # every byte somewhere
    packed[1, :128] = torch.arange(128, dtype=torch.uint8) * 2 + 1
    bytes_ = torch.arange(256, dtype=torch.uint8).repeat(rows * cols // 16 // 256 + 1)
    scales = bytes_[: (rows // block_rows) * (cols // 16)].reshape(rows // block_rows, -1)
    scales = scales.view(torch.float8_e4m3fn)  # every E4M3 byte, NaN and negative included
    for value in (1.0, 0.37, 1e-30, 3e38, float("inf")):
        tensor_scale = torch.tensor(value)
        want = op(packed, scales, tensor_scale, block_rows)
        for device_scale in (tensor_scale.cuda(), tensor_scale):  # a CPU scale is read too
            got = op(packed.cuda(), scales.cuda(), device_scale, block_rows)
            values_equal(got, want, f"tensor scale {value} on {device_scale.device}")
    # A view whose data starts off an 8-byte boundary: byte-by-byte loads.
    storage = torch.randint(0, 256, (rows * cols // 2 + 3,), dtype=torch.uint8, generator=g)
    view = storage[3:].reshape(rows, cols // 2)
    want = op(view, scales, torch.tensor(0.5), block_rows)
    values_equal(
        op(on_gpu(view), scales.cuda(), torch.tensor(0.5).cuda(), block_rows), want, "view"
    )


def fp8_codes(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random FP8 bytes with every byte value among the first 256."""
    g = torch.Generator().manual_seed(seed)
    n = shape[0] * shape[1]
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    b[: min(n, 256)] = torch.arange(min(n, 256), dtype=torch.uint8)
    return b.view(dtype).reshape(shape)


def fp32_scales(n: int, seed: int) -> torch.Tensor:
    s = random_fp32(n, seed).abs()
    if n >= 4:
        s[:4] = torch.tensor([0.0, float("inf"), float("nan"), 1e-45])
    return s


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(256, 256), (33, 130), (128, 384), (1, 7), (300, 1)])
def test_dequantize_blocks_matches_the_cpu(ops, dtype, shape):
    op = ops["dequantize_blocks"]
    data = fp8_codes(shape, dtype, shape[0] + shape[1])
    rows, cols = shape
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    for block_rows, block_cols in ((0, 0), (1, 0), (0, 1), (1, 128), (128, 128), (3, 5)):
        grid_r = cdiv(rows, block_rows) if block_rows else 1
        grid_c = cdiv(cols, block_cols) if block_cols else 1
        scales = fp32_scales(grid_r * grid_c, rows).reshape(grid_r, grid_c)
        want = op(data, scales, block_rows, block_cols)
        got = op(data.cuda(), scales.cuda(), block_rows, block_cols)
        values_equal(got, want, f"blocks {block_rows}x{block_cols}")
        # The transposed view (column-wise layouts), read in place on both devices.
        t = data.t()
        grid_r_t = cdiv(cols, block_rows) if block_rows else 1
        if block_cols in (0,) or block_cols >= rows:
            scales_t = fp32_scales(grid_r_t * (cdiv(rows, block_cols) if block_cols else 1), cols)
            want = op(t, scales_t, block_rows, block_cols)
            got = op(data.cuda().t(), scales_t.cuda(), block_rows, block_cols)
            values_equal(got, want, f"transposed blocks {block_rows}x{block_cols}")
    if cols % 32 == 0:  # MXFP8: E8M0 bytes, every one of them (255 is NaN)
        e8m0 = torch.arange(256, dtype=torch.uint8).repeat(rows * cols // 32 // 256 + 1)
        e8m0 = e8m0[: rows * cols // 32].reshape(rows, cols // 32)
        want = op(data, e8m0, 1, 32)
        values_equal(op(data.cuda(), e8m0.cuda(), 1, 32), want, "e8m0")


# ---- delayed_update --------------------------------------------------------------------


def history_case(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    history = torch.rand(rows, cols, generator=g) * torch.exp2(
        torch.randint(-20, 20, (rows, cols), generator=g).float()
    )
    history[0, ::3] = 0.0  # columns that did not record this step
    if cols >= 8:
        history[0, 1] = float("nan")  # NaN is not > 0: no update
        history[rows // 2, 2] = float("nan")  # a NaN window amax keeps the old scale
        history[rows - 1, 4] = float("inf")
        history[:, 5] = 0.0
        history[0, 7] = 1e-40
    scale = torch.rand(cols, generator=g) + 0.5
    return history, scale


@pytest.mark.parametrize(("rows", "cols"), [(1, 9), (2, 16), (5, 3), (1024, 10), (1500, 300)])
def test_delayed_update_matches_the_cpu(ops, rows, cols):
    op = ops["delayed_update"]
    for most_recent, min_scale, floor in itertools.product((False, True), (0.0, 2.0), (0.0, 1e-3)):
        history, scale = history_case(rows, cols, rows * cols)
        g_history, g_scale = history.cuda(), scale.cuda()
        op(history, scale, 448.0, floor, min_scale, most_recent)
        op(g_history, g_scale, 448.0, floor, min_scale, most_recent)
        what = f"most_recent={most_recent} min_scale={min_scale} floor={floor}"
        assert_same(g_history, history, f"history {what}")
        assert_same(g_scale, scale, f"scale {what}")


# ---- how they launch -------------------------------------------------------------------


def _launch_all(ops, x, history, scale):
    q = ops["quantize_nvfp4"](x, False, True, True, False, None, None)
    ops["quantize_nvfp4"](x, True, True, True, False, None, None)
    rand = torch.rand(x.shape, device=x.device)
    ops["quantize_nvfp4"](x, False, True, True, True, rand, rand.t().contiguous())
    ops["delayed_update"](history, scale, 448.0, 0.0, 0.0, False)
    ops["dequantize_blocks"](x.to(torch.float8_e4m3fn), scale[:1], 0, 0)
    return q + (ops["dequantize_nvfp4"](q[0], q[1], q[4], 1),)


def test_no_host_sync(ops):
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    history = torch.rand(16, 4, device="cuda")
    scale = torch.ones(4, device="cuda")
    _launch_all(ops, x, history, scale)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _launch_all(ops, x, history, scale)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def test_capturable_in_a_cuda_graph(ops):
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    history = torch.rand(16, 4, device="cuda")
    scale = torch.ones(4, device="cuda")
    torch.manual_seed(0)
    eager = _launch_all(ops, x, history.clone(), scale.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _launch_all(ops, x, history.clone(), scale.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    h, s = history.clone(), scale.clone()
    with torch.cuda.graph(graph):
        captured = _launch_all(ops, x, h, s)
    graph.replay()
    torch.cuda.synchronize()
    for i in (0, 1, 2, 3, 4):  # the deterministic outputs
        assert torch.equal(bits(captured[i]), bits(eager[i])), i
    values_equal(captured[5], eager[5].cpu(), "dequantized")


def test_auto_mode_routes_cuda_tensors_to_the_native_kernels(ops, monkeypatch):
    monkeypatch.delenv("FASTCAST_KERNELS", raising=False)
    choice.refresh()
    try:
        x = torch.empty(4, 4, device="cuda")
        for name in NATIVE:
            assert choice.fused_op(name, x) is ops[name], name
    finally:
        choice.refresh()
