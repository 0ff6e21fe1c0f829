"""Which CUDA quantize implementation ``choice`` hands out, without a GPU: the native CUDA
kernels where they are built (the CPU library's entry points, which the dispatcher routes
to them), Inductor's compiled operators for the operators without one, one warning when
the native kernels do not build, and nothing native at all on a CPU build of torch
(simulated CUDA included)."""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
from fake_cuda import on_fresh_thread, simulated_cuda

from fastcast.kernels import build, choice
from fastcast.quantizers.nvfp4 import NVFP4Quantizer

SM90 = (9, 0)


def fresh_thread(test):
    """On a thread of its own, as test_fake_cuda's tests (its delayed-scaling state dies
    with the thread)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return on_fresh_thread(lambda: test(*args, **kwargs))

    return run


@pytest.fixture
def entry_points():
    try:
        return build.entry_points()
    except build.BuildError:
        pytest.skip("the fused kernels are not available here")


@fresh_thread
def test_a_cpu_torch_has_no_native_cuda_kernels_and_says_nothing(entry_points):
    assert not build.cuda_torch()  # a CPU wheel, whatever torch.cuda is made to answer
    with simulated_cuda(SM90):
        assert not build.cuda_torch()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            op = choice.fused_op("quantize_tensorwise", torch.empty(4, 4, device="cuda"))
        assert op is not entry_points["quantize_tensorwise"]  # Inductor's, as before


@fresh_thread
def test_native_kernels_where_built_and_compiled_operators_elsewhere(entry_points, monkeypatch):
    monkeypatch.setattr(build, "cuda_torch", lambda: True)
    monkeypatch.setattr(build, "load_cuda", lambda: 0.0)
    monkeypatch.setattr(build, "cuda_ops", lambda: ("quantize_tensorwise", "record_amax"))
    with simulated_cuda(SM90):
        x = torch.empty(4, 4, device="cuda")
        assert choice.fused_op("quantize_tensorwise", x) is entry_points["quantize_tensorwise"]
        assert choice.fused_op("record_amax", x) is entry_points["record_amax"]
        rows = choice.fused_op("quantize_rows", x)
        assert rows is not None and rows is not entry_points["quantize_rows"]
        assert rows.__name__ == "quantize_rows"  # the compiled wrapper
        # FASTCAST_KERNELS=compiled: Inductor for every operator (to compare on a GPU).
        monkeypatch.setenv("FASTCAST_KERNELS", "compiled")
        choice.refresh()
        assert choice.fused_op("quantize_tensorwise", x) is not entry_points["quantize_tensorwise"]
        monkeypatch.delenv("FASTCAST_KERNELS")
        choice.refresh()


@fresh_thread
def test_native_kernels_that_do_not_build_warn_once(entry_points, monkeypatch):
    def no_nvcc() -> float:
        raise build.BuildError("nvcc is not found (set CUDA_HOME to a CUDA toolkit)")

    monkeypatch.setattr(build, "cuda_torch", lambda: True)
    monkeypatch.setattr(build, "load_cuda", no_nvcc)
    with simulated_cuda(SM90):
        x = torch.empty(4, 4, device="cuda")
        with pytest.warns(RuntimeWarning, match="native CUDA quantize kernels.*nvcc"):
            op = choice.fused_op("quantize_tensorwise", x)
        assert op is not None and op is not entry_points["quantize_tensorwise"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert choice.fused_op("quantize_rows", x) is not None  # warned once only


@fresh_thread
def test_fused_mode_accepts_native_kernels_without_triton_only_when_they_cover_all(
    entry_points, monkeypatch
):
    monkeypatch.setattr(build, "cuda_torch", lambda: True)
    monkeypatch.setattr(build, "load_cuda", lambda: 0.0)
    monkeypatch.setattr(build, "cuda_ops", lambda: ("quantize_tensorwise",))
    monkeypatch.setenv("FASTCAST_KERNELS", "fused")
    with simulated_cuda(SM90, triton=False):
        with pytest.raises(RuntimeError, match="FASTCAST_KERNELS=fused"):
            choice.fused_op("quantize_tensorwise", torch.empty(4, 4, device="cuda"))
    monkeypatch.delenv("FASTCAST_KERNELS")
    with simulated_cuda(SM90, triton=False):
        x = torch.empty(4, 4, device="cuda")
        with pytest.warns(RuntimeWarning, match="without a native CUDA kernel"):
            assert choice.fused_op("quantize_tensorwise", x) is entry_points["quantize_tensorwise"]
        assert choice.fused_op("quantize_rows", x) is None  # the reference


# The operators the CUDA sources register kernels for (m.impl in a
# TORCH_LIBRARY_IMPL(fastcast_kernels, CUDA, m) block): what build.cuda_ops() reports
# once they are built, so what choice hands out for CUDA tensors.
NATIVE_CUDA = {
    "quantize_tensorwise",
    "record_amax",
    "quantize_recording",
    "delayed_update",
    "quantize_rows",
    "quantize_blocks",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "dequantize_blocks",
    "dequantize_nvfp4",
}
_CUDA_BLOCK = re.compile(r"TORCH_LIBRARY_IMPL\(fastcast_kernels, CUDA, m\) \{(.*?)\n\}", re.S)
_IMPL = re.compile(r'm\.impl\("(\w+)"')


def registered_in_sources() -> list[str]:
    names: list[str] = []
    for source in build.CUDA_SOURCES:
        for block in _CUDA_BLOCK.findall(source.read_text()):
            names += _IMPL.findall(block)
    return names


def test_the_cuda_sources_register_a_kernel_for_each_native_operator():
    names = registered_in_sources()
    assert len(names) == len(set(names)), "an operator registered twice"
    assert set(names) == NATIVE_CUDA
    assert NATIVE_CUDA <= set(build.OPS)  # schemas the CPU library defines


@fresh_thread
def test_nvfp4_dequantize_and_delayed_update_take_their_native_kernels(entry_points, monkeypatch):
    monkeypatch.setattr(build, "cuda_torch", lambda: True)
    monkeypatch.setattr(build, "load_cuda", lambda: 0.0)
    monkeypatch.setattr(build, "cuda_ops", lambda: tuple(sorted(NATIVE_CUDA)))
    with simulated_cuda(SM90) as launches:
        x = torch.randn(32, 64, device="cuda")
        for name in ("quantize_nvfp4", "dequantize_nvfp4", "dequantize_blocks", "delayed_update"):
            assert choice.fused_op(name, x) is entry_points[name], name
        # Through the quantizer: the native entry point (the fake kernel here), no
        # Inductor operator, the layouts' shapes as the CUDA kernel returns them.
        for block_2d in (False, True):
            quantizer = NVFP4Quantizer(block_2d=block_2d, stochastic_rounding=True)
            q = quantizer.quantize(x, rowwise=True, columnwise=True)
            assert q.data.shape == (32, 32) and q.data_t.shape == (64, 16)
            assert q.scale_inv.shape == ((2, 4) if block_2d else (32, 4))
            assert q.scale_inv_t.shape == ((4, 2) if block_2d else (64, 2))
            assert q.dequantize(torch.float32).shape == (32, 64)
        assert launches.compiled_ops == []
