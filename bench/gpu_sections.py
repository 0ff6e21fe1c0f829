"""The parts of ``make gpu-check`` that run in-process (``bench.gpu_check`` runs them in
child processes): ``python -m bench.gpu_sections PART[,PART...] OUT_DIR [--smoke]``.

Each part is a function of a ``Setup`` (device, sizes) returning a JSON-able dict; the
line ``{"part", "seconds", "result"}`` (or ``"error"``) is appended to
``OUT_DIR/sections.jsonl`` as soon as the part ends. ``--smoke`` runs them on the CPU at
small sizes, which checks this code, not the GPU.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fastcast as fc
from bench.cuda_host_estimate import fwd_bwd
from fastcast.gemm_grouped import grouped_scaling
from fastcast.kernels import choice
from fastcast.runtime import hardware

RECIPES: dict[str, fc.Recipe] = {
    "delayed": fc.DelayedScaling(amax_history_len=16),
    "current": fc.Float8CurrentScaling(),
    "current_pow2": fc.Float8CurrentScaling(use_power_2_scales=True),
    "rowwise": fc.Float8RowwiseScaling(),
    "block": fc.Float8BlockScaling(),
    "block_f32": fc.Float8BlockScaling(use_f32_scales=True),
    "mxfp8": fc.MXFP8BlockScaling(),
    "nvfp4": fc.NVFP4BlockScaling(),
    "nvfp4_plain": fc.NVFP4BlockScaling(stochastic_rounding=False, random_hadamard_transform=False),
}
# The recipes a layer is trained with (the variants above only change quantizer numerics).
TRAINING = ("delayed", "current", "rowwise", "block", "mxfp8", "nvfp4")
ROLES = ("input", "weight", "grad_output")


@dataclass
class Setup:
    device: str
    smoke: bool

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


# -- timing ---------------------------------------------------------------------------


def device_ms(setup: Setup, fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the device (CUDA events; wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    setup.sync()
    times = []
    for _ in range(reps):
        if setup.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernels_mode(mode: str) -> None:
    """Route quantizers as ``FASTCAST_KERNELS=mode`` would (``auto``: the default)."""
    os.environ["FASTCAST_KERNELS"] = mode
    hardware.refresh()


def compare_modes(setup: Setup) -> list[str]:
    """The kernel modes worth timing: ``auto``, and ``compiled`` (Inductor's operators)
    where ``auto`` runs native CUDA kernels for some of them."""
    native = any("inductor" not in impl for impl in cuda_routing().values())
    # GPU_CHECK_AUTO_ONLY=1: skip the Inductor comparison (its cold compiles cost minutes
    # on a fresh machine; an earlier run's figures may already hold it).
    skip = os.environ.get("GPU_CHECK_AUTO_ONLY") == "1"
    return ["auto", "compiled"] if setup.device == "cuda" and native and not skip else ["auto"]


def cuda_routing() -> dict[str, str]:
    """Which implementation each quantize operator runs on CUDA tensors now."""
    if not torch.cuda.is_available():
        return {}
    probe = torch.zeros(1, device="cuda")
    routing = {}
    for name in (
        "quantize_tensorwise",
        "quantize_rows",
        "quantize_blocks",
        "quantize_mxfp8",
        "quantize_nvfp4",
        "quantize_recording",
        "record_amax",
    ):
        op = choice.fused_op(name, probe)
        routing[name] = (
            "reference" if op is None else getattr(op, "__module__", None) or type(op).__name__
        )
    return routing


# -- env and build --------------------------------------------------------------------


def _command(args: list[str]) -> str:
    if shutil.which(args[0]) is None:
        return f"{args[0]}: not found"
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    return (done.stdout or done.stderr).strip()


def env(setup: Setup) -> dict:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": os.environ.get("GPU_CHECK_COMMIT", ""),
        "cpu_count": os.cpu_count(),
        "has_F_scaled_mm": hasattr(torch.nn.functional, "scaled_mm"),
        "has_scaled_grouped_mm": hasattr(torch, "_scaled_grouped_mm"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    nvcc = _command(["nvcc", "--version"]).splitlines()
    info["nvcc"] = nvcc[-1] if nvcc else ""
    if setup.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            capability=".".join(map(str, torch.cuda.get_device_capability())),
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            cublaslt=torch.backends.cuda.preferred_blas_library().name
            if hasattr(torch.backends.cuda, "preferred_blas_library")
            else None,
            driver=_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        )
    info["fp8_available"] = {
        name: list(fn())
        for name, fn in (
            ("fp8", fc.fp8_available),
            ("rowwise", fc.fp8_rowwise_available),
            ("block", fc.fp8_block_scaling_available),
            ("mxfp8", fc.mxfp8_available),
            ("nvfp4", fc.nvfp4_available),
        )
    }
    return info


def build(setup: Setup) -> dict:
    """The fused kernels built against this torch (the CPU library; the CUDA one where
    this fastcast has it), then which implementation each CUDA operator runs."""
    from fastcast.kernels import build as kbuild

    result: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        result["cpu_library_s"] = round(kbuild.load(), 1)
    except kbuild.BuildError as exc:
        result["cpu_library_error"] = str(exc)[-2000:]
    cuda_build = getattr(kbuild, "load_cuda", None)
    if cuda_build is not None and setup.device == "cuda":
        try:
            result["cuda_library_s"] = round(cuda_build(), 1)
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            result["cuda_library_error"] = f"{type(exc).__name__}: {exc}"[-3000:]
    else:
        result["cuda_library"] = "not in this fastcast" if cuda_build is None else "no GPU"
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["c_autocast"] = sys.modules["fastcast.autocast"]._native is not None
    result["cuda_routing"] = cuda_routing()
    return result


# -- parity: CUDA codes and scales against the CPU's ----------------------------------


def _inputs(setup: Setup) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    all_bf16 = bits.view(torch.bfloat16)
    finite = all_bf16[torch.isfinite(all_bf16)]
    finite = finite[torch.randperm(finite.numel(), generator=gen)]
    pad = 256 * 256 - finite.numel()
    all_finite = torch.cat([finite, torch.zeros(pad, dtype=torch.bfloat16)]).reshape(256, 256)
    rows, cols = (64, 256) if setup.smoke else (512, 1024)
    randn = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    randn[3, 7], randn[9, 100], randn[11, 5] = 3.0e4, -7.5e3, 1e-30
    special = torch.randn(128, 256, generator=gen)
    special[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38])
    special[5, 200] = float("nan")
    special[64:, :] *= 1e-3
    return {
        "bf16_all_finite": all_finite,
        "bf16_all_patterns": all_bf16.reshape(256, 256),
        "randn_outliers_fp32": randn,
        "randn_outliers_bf16": randn.bfloat16(),
        "randn_fp16": (randn / 8).half(),
        "nonfinite_fp32": special,
        "unaligned_33x160": torch.randn(33, 160, generator=gen),
        "unaligned_130x96_bf16": torch.randn(130, 96, generator=gen).bfloat16(),
        "tiny_1x32": torch.randn(1, 32, generator=gen),
    }


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _compare(q_cpu: fc.QuantizedTensor, q_dev: fc.QuantizedTensor) -> dict:
    names_cpu, ctx_cpu = q_cpu.__tensor_flatten__()
    names_dev, ctx_dev = q_dev.__tensor_flatten__()
    if names_cpu != names_dev or ctx_cpu != ctx_dev:
        return {
            "equal": False,
            "why": f"layouts differ: {names_cpu} {ctx_cpu} / {names_dev} {ctx_dev}",
        }
    bad = {}
    for name in names_cpu:
        a, b = getattr(q_cpu, name), getattr(q_dev, name).cpu()
        if a.shape != b.shape or a.dtype != b.dtype:
            bad[name] = f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
            continue
        diff = (_as_bytes(a) != _as_bytes(b)).reshape(-1)
        if diff.any():
            first = int(diff.nonzero()[0])
            bad[name] = f"{int(diff.sum())}/{diff.numel()} bytes differ, first at byte {first}"
    return {"equal": not bad, **({"differ": bad} if bad else {})}


def parity(setup: Setup) -> dict:
    dev = setup.device
    cases: dict[str, Any] = {}
    failures = []
    inputs = _inputs(setup)
    for rname, recipe in RECIPES.items():
        if rname in ("delayed",):
            continue
        if rname == "nvfp4":  # stochastic rounding draws differ by device: op-level below
            recipe = fc.NVFP4BlockScaling(stochastic_rounding=False)
        for iname, x in inputs.items():
            for role in ROLES:
                key = f"{rname}/{iname}/{role}"
                try:
                    q_cpu = fc.quantize(x, recipe, role, columnwise=True)
                except Exception as exc:  # noqa: BLE001 - refused inputs must be refused on both
                    try:
                        fc.quantize(x.to(dev), recipe, role, columnwise=True)
                        cases[key] = {"equal": False, "why": f"CPU refused ({exc}), device did not"}
                    except Exception:  # noqa: BLE001
                        cases[key] = {"equal": True, "refused": type(exc).__name__}
                    continue
                q_dev = fc.quantize(x.to(dev), recipe, role, columnwise=True)
                cases[key] = _compare(q_cpu, q_dev)
                if not cases[key]["equal"]:
                    failures.append(key)
    cases.update(_parity_ops(setup, inputs, failures))
    return {
        "cases": len(cases),
        "equal": sum(c["equal"] for c in cases.values()),
        "failures": {k: cases[k] for k in failures},
        "routing": cuda_routing(),
    }


def _parity_ops(setup: Setup, inputs: dict[str, torch.Tensor], failures: list[str]) -> dict:
    """Operators the quantizers reach with device-drawn state: delayed scaling's recording
    cast and amax record, NVFP4's stochastic rounding with the same draws on both sides."""
    out: dict[str, Any] = {}
    dev = setup.device
    gen = torch.Generator().manual_seed(1)
    for iname in (
        "randn_outliers_fp32",
        "randn_outliers_bf16",
        "nonfinite_fp32",
        "unaligned_33x160",
    ):
        x = inputs[iname]
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            key = f"quantize_recording/{iname}/{str(dtype)[-6:]}"
            res = []
            for d in ("cpu", dev):
                xd = x.to(d)
                op = choice.fused_op("quantize_recording", xd)
                scale = torch.tensor([0.37], device=d)
                slot = torch.zeros(1, device=d)
                if op is None:
                    from fastcast.kernels.inductor import quantize_recording as op
                data, scale_inv = op(xd, scale, slot, dtype)
                res.append((data.cpu(), scale_inv.cpu(), slot.cpu()))
            equal = all(torch.equal(_as_bytes(a), _as_bytes(b)) for a, b in zip(res[0], res[1]))
            out[key] = {"equal": equal}
            if not equal:
                failures.append(key)
        x = inputs[iname].float()
        rows, cols = x.shape
        if cols % 16 or rows % 16:
            continue
        rand = torch.rand((rows, cols), generator=gen)
        rand_t = torch.rand((cols, rows), generator=gen)
        key = f"quantize_nvfp4_stochastic/{iname}"
        res = []
        for d in ("cpu", dev):
            xd = x.to(d)
            op = choice.fused_op("quantize_nvfp4", xd)
            if op is None:
                from fastcast.reference.nvfp4 import quantize_reference as op
            res.append([t.cpu() for t in op(xd, False, True, True, True, rand.to(d), rand_t.to(d))])
        equal = all(torch.equal(_as_bytes(a), _as_bytes(b)) for a, b in zip(*res))
        out[key] = {"equal": equal}
        if not equal:
            failures.append(key)
    return out


# -- GEMMs ----------------------------------------------------------------------------


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def gemm(setup: Setup) -> dict:
    dev = setup.device
    torch.manual_seed(0)
    m, k, n = (64, 256, 128) if setup.smoke else (512, 1024, 768)
    x = torch.randn(m, k, device=dev)
    w = torch.randn(n, k, device=dev) / 16
    g = torch.randn(m, n, device=dev)
    result: dict[str, Any] = {}
    for rname, recipe in RECIPES.items():
        if rname == "delayed":
            continue
        qx = fc.quantize(x, recipe, "input", columnwise=True)
        qw = fc.quantize(w, recipe, "weight", columnwise=True)
        qg = fc.quantize(g, recipe, "grad_output", columnwise=True)
        products = {
            "fprop": (qx, qw),
            "dgrad": (qg, qw.t()),
            "wgrad": (qg.columnwise_operand(), qx.columnwise_operand()),
        }
        per = {}
        for pname, (a, b) in products.items():
            ref = (
                a.dequantize(torch.float64).reshape(-1, a.shape[-1])
                @ b.dequantize(torch.float64).t()
            )
            entry: dict[str, Any] = {}
            for out_dtype in (torch.float32, torch.bfloat16):
                tag = str(out_dtype)[6:]
                for backend in ("emulate", "hardware", None):
                    name = f"{backend or 'auto'}_{tag}"
                    try:
                        with warnings.catch_warnings(record=True) as caught:
                            warnings.simplefilter("always")
                            out = fc.scaled_mm(a, b, out_dtype=out_dtype, backend=backend)
                        entry[name] = round(_rel_err(out, ref), 9)
                        if caught:
                            entry[name + "_warning"] = str(caught[0].message)[:160]
                    except Exception as exc:  # noqa: BLE001 - which products have no kernel
                        entry[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
            family = a.family if a.family == b.family else "mixed"
            entry["backend"] = hardware.gemm_backend(a.data.device.type, family)[1]
            per[pname] = entry
        result[rname] = per
    result["block_scaled_probe"] = block_scaled_probe(setup)
    result["grouped"] = grouped(setup)
    return result


def block_scaled_probe(setup: Setup) -> dict:
    """Whether torch's block-scaled FP8 GEMMs (1x128 x 128x128 on sm90) take fastcast's
    own 1x128/128x128 operands, and agree with the emulation: each call form tried."""
    if setup.device != "cuda":
        return {"skipped": "needs CUDA"}
    torch.manual_seed(5)
    m, k, n = 256, 1024, 512
    recipe = fc.Float8BlockScaling(use_f32_scales=True)
    qx = fc.quantize(torch.randn(m, k, device="cuda"), recipe, "input")
    qw = fc.quantize(torch.randn(n, k, device="cuda") / 16, recipe, "weight")
    ref = fc.scaled_mm(qx, qw, out_dtype=torch.float32, backend="emulate").double()
    sa, sb = qx.scale_inv, qw.scale_inv  # [m, k/128], [n/128, k/128]
    info: dict[str, Any] = {"scale_shapes": [list(sa.shape), list(sb.shape)]}
    col_a = sa.t().contiguous().t()  # [m, k/128], stride (1, m)
    l4 = -(-sb.shape[1] // 4) * 4
    padded = torch.zeros(sb.shape[0], l4, device="cuda")
    padded[:, : sb.shape[1]] = sb
    col_b = padded.t()  # [l4, n/128], stride (1, l4)
    forms: dict[str, Callable[[], torch.Tensor]] = {
        "_scaled_mm(sa, sb.t())": lambda: torch._scaled_mm(
            qx.data, qw.data.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16
        ),
        "_scaled_mm(col sa, col sb.t())": lambda: torch._scaled_mm(
            qx.data,
            qw.data.t(),
            scale_a=col_a,
            scale_b=sb.t().contiguous().t(),
            out_dtype=torch.bfloat16,
        ),
        "_scaled_mm(col sa, sb.t() contiguous)": lambda: torch._scaled_mm(
            qx.data,
            qw.data.t(),
            scale_a=col_a,
            scale_b=sb.t().contiguous(),
            out_dtype=torch.bfloat16,
        ),
    }
    F = torch.nn.functional
    if hasattr(F, "scaled_mm"):
        st = F.ScalingType
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)

        def tiles(out_dtype: torch.dtype, with_bias: bool = False) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                out = F.scaled_mm(
                    qx.data,
                    qw.data.t(),
                    col_a,
                    st.BlockWise1x128,
                    col_b,
                    st.BlockWise128x128,
                    bias=bias if with_bias else None,
                    output_dtype=out_dtype,
                )
                return out - bias if with_bias else out

            return call

        forms["F.scaled_mm(1x128, 128x128)"] = tiles(torch.bfloat16)
        forms["F.scaled_mm(1x128, 128x128) fp32 out"] = tiles(torch.float32)
        forms["F.scaled_mm(1x128, 128x128) bf16 + bias"] = tiles(torch.bfloat16, with_bias=True)
    for name, call in forms.items():
        try:
            out = call()
            torch.cuda.synchronize()
            info[name] = {"rel_err_vs_emulation": round(_rel_err(out, ref), 6)}
            reps = 20
            info[name]["ms"] = round(device_ms(setup, call, reps), 4)
        except Exception as exc:  # noqa: BLE001 - the probe records what torch refuses
            info[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    info["emulated_ms"] = round(
        device_ms(
            setup, lambda: fc.scaled_mm(qx, qw, out_dtype=torch.bfloat16, backend="emulate"), 20
        ),
        4,
    )
    bf16_x, bf16_w = qx.dequantize(torch.bfloat16), qw.dequantize(torch.bfloat16)
    info["bf16_matmul_ms"] = round(device_ms(setup, lambda: bf16_x @ bf16_w.t(), 20), 4)
    return info


def grouped(setup: Setup) -> dict:
    """fc.grouped_mm (mixture-of-experts) per recipe: the default path against the
    emulation and the float64 product, groups of uneven sizes."""
    dev = setup.device
    torch.manual_seed(7)
    experts, k, n = 4, 256, 128
    sizes = [48, 0, 112, 96]
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), k, device=dev)
    w = torch.randn(experts, n, k, device=dev) / 16
    ref = torch.cat([xi.double() @ w[e].double().t() for e, xi in enumerate(torch.split(x, sizes))])
    out: dict[str, Any] = {}
    for rname in TRAINING:
        recipe = RECIPES[rname]
        if rname == "delayed":
            continue
        entry = {}
        for mode in ("auto", "emulate"):
            os.environ["FASTCAST_GEMM"] = mode
            hardware.refresh()
            try:
                y = fc.grouped_mm(x, w, offs, recipe)
                entry[mode] = round(_rel_err(y[: ref.shape[0]], ref), 5)
                family = grouped_scaling(recipe).family
                entry[mode + "_backend"] = hardware.grouped_gemm_backend(dev, family)[1]
            except Exception as exc:  # noqa: BLE001
                entry[mode] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out[rname] = entry
    os.environ.pop("FASTCAST_GEMM", None)
    hardware.refresh()
    return out


# -- speed: bandwidth, host time, profile ----------------------------------------------


def bandwidth(setup: Setup) -> dict:
    """Quantize GB/s (bytes read + written) of a bf16 activation with both layouts, at
    three sizes, against a device-to-device copy of the same tensor."""
    sizes = [(256, 256), (512, 512)] if setup.smoke else [(1024, 1024), (4096, 4096), (8192, 8192)]
    modes = compare_modes(setup)
    native_nvfp4 = "inductor" not in cuda_routing().get("quantize_nvfp4", "inductor")
    result: dict[str, Any] = {"modes": modes}
    for rows, cols in sizes:
        x = torch.randn(rows, cols, device=setup.device).bfloat16()
        y = torch.empty_like(x)
        copy_ms = device_ms(setup, lambda x=x, y=y: y.copy_(x), 20)
        copy_gbs = 2 * x.nbytes / copy_ms / 1e6
        entry: dict[str, Any] = {"copy_GBps": round(copy_gbs, 1)}
        for rname in ("current", "rowwise", "block", "mxfp8", "nvfp4_plain", "nvfp4"):
            if (
                setup.device == "cuda"
                and rname.startswith("nvfp4")
                and not native_nvfp4
                and modes == ["auto"]
            ):
                continue  # Inductor's operator: timed by a run with the comparison on
            recipe = RECIPES[rname]
            for mode in modes:
                kernels_mode(mode)
                q = fc.quantize(x, recipe, "grad_output", columnwise=True)
                ms = device_ms(
                    setup,
                    lambda x=x, r=recipe: fc.quantize(x, r, "grad_output", columnwise=True),
                    20,
                )
                gbs = (x.nbytes + q.nbytes) / ms / 1e6
                entry[f"{rname}/{mode}"] = {
                    "ms": round(ms, 4),
                    "GBps": round(gbs, 1),
                    "of_copy": round(gbs / copy_gbs, 3),
                }
        result[f"{rows}x{cols}"] = entry
    kernels_mode("auto")
    # The largest size once more under the profiler: which kernels take the time.
    from torch.profiler import ProfilerActivity  # noqa: PLC0415
    from torch.profiler import profile as torch_profile  # noqa: PLC0415

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.cuda else [])
    for rname in ("current", "rowwise", "block", "mxfp8", "nvfp4"):
        with torch_profile(activities=activities) as prof:
            fc.quantize(x, RECIPES[rname], "grad_output", columnwise=True)
            setup.sync()
        result[f"kernels_us/{rname}"] = kernel_time_table(device_kernels(prof.events()), 1, 6)
    return result


def host_us(step: Callable[[], None], setup: Setup, calls: int) -> tuple[float, float]:
    """(median host µs per call with no sync in the loop, wall µs per call including the
    device's catching up at the end)."""
    for _ in range(20):
        step()
    setup.sync()
    times = []
    start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    setup.sync()
    wall = (time.perf_counter() - start) / calls
    return statistics.median(times) * 1e6, wall * 1e6


def host_time(setup: Setup) -> dict:
    dev, calls = setup.device, (50 if setup.smoke else 300)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    x = torch.randn(64, 64, device=dev, dtype=dtype, requires_grad=True)
    base_layer = nn.Linear(64, 64, device=dev, dtype=dtype)
    # nn.Linear before and after the recipes, the lower taken: a busy host moment then
    # costs the baseline no more than the layers it is compared with.
    base, base_wall = host_us(fwd_bwd(base_layer, x, None), setup, calls)
    result: dict[str, Any] = {
        "nn.Linear_us": round(base, 1),
        "nn.Linear_wall_us": round(base_wall, 1),
    }
    for mode in compare_modes(setup):
        kernels_mode(mode)
        for rname in TRAINING:
            layer = fc.convert(nn.Sequential(nn.Linear(64, 64, device=dev, dtype=dtype)))
            us, wall = host_us(fwd_bwd(layer, x, RECIPES[rname]), setup, calls)
            result[f"{rname}/{mode}"] = {"us": round(us, 1), "wall_us": round(wall, 1)}
    kernels_mode("auto")
    again, _ = host_us(fwd_bwd(base_layer, x, None), setup, calls)
    result["nn.Linear_again_us"] = round(again, 1)
    base = min(base, again)
    for entry in result.values():
        if isinstance(entry, dict):
            entry["ratio"] = round(entry["us"] / base, 2)
    return result


def device_kernels(events: Any) -> list:
    """The kernels among a profile's device events: no copies or memsets, and no ranges
    (a ``record_function`` range also appears on the device's timeline, spanning its
    kernels: counted, it would double their time)."""
    return [
        e
        for e in events
        if e.device_type.name == "CUDA"
        and "Memcpy" not in e.name
        and "Memset" not in e.name
        and not e.name.startswith(("fastcast", "## "))
    ]


def kernel_time_table(kernels: list, calls: int, top: int) -> dict[str, float]:
    """Device µs per call of the ``top`` kernels by time (names cut to 90 characters)."""
    times: dict[str, float] = {}
    for e in kernels:
        times[e.name[:90]] = times.get(e.name[:90], 0.0) + e.device_time / calls
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {name: round(us, 1) for name, us in ranked}


def profile(setup: Setup) -> dict:
    """Per fc.Linear fwd+bwd (512x1024 -> 1024): device kernels, fastcast ranges, ATen
    operators, host-to-device copies and synchronisations, from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dev = setup.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    x = torch.randn(512, 1024, device=dev, dtype=dtype, requires_grad=True)
    calls = 4
    result: dict[str, Any] = {}
    fc.profiling.enable()
    try:
        for rname in (None, *TRAINING):
            layer = fc.convert(nn.Sequential(nn.Linear(1024, 1024, device=dev, dtype=dtype)))
            step = fwd_bwd(layer, x, RECIPES[rname] if rname else None)
            for _ in range(3):
                step()
            setup.sync()
            with torch_profile(activities=activities) as prof:
                for _ in range(calls):
                    step()
                setup.sync()
            events = prof.events()
            kernels = device_kernels(events)
            names: dict[str, int] = {}
            for e in kernels:
                names[e.name[:80]] = names.get(e.name[:80], 0) + 1
            cpu = [e for e in events if e.device_type.name == "CPU"]
            result[rname or "nn.Linear"] = {
                "kernels_per_call": len(kernels) / calls,
                "kernel_us_per_call": round(sum(e.device_time for e in kernels) / calls, 1)
                if kernels
                else 0.0,
                "aten_ops_per_call": sum(e.name.startswith("aten::") for e in cpu) / calls,
                "fastcast_ranges_per_call": sum(e.name.startswith("fastcast") for e in cpu) / calls,
                "htod_copies_per_call": sum("HtoD" in e.name for e in events) / calls,
                "syncs_per_call": sum(
                    e.name
                    in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
                    for e in events
                )
                / calls,
                "top_kernels": dict(sorted(names.items(), key=lambda kv: -kv[1])[:6]),
                "top_kernels_us": kernel_time_table(kernels, calls, 8),
            }
    finally:
        fc.profiling.disable()
    return result


# -- CUDA graphs ----------------------------------------------------------------------


def cuda_graph(setup: Setup) -> dict:
    """A training step (forward, backward) captured in a CUDA graph and replayed: the
    replay's output and gradients against the same step run eagerly."""
    if setup.device != "cuda":
        return {"skipped": "needs CUDA"}
    result: dict[str, Any] = {}
    for rname in TRAINING:
        recipe = RECIPES[rname]
        torch.manual_seed(0)
        layer = fc.convert(nn.Sequential(nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)))
        static_x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
        step = _layer_step_out(layer, static_x, recipe)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    layer.zero_grad(set_to_none=True)
                    step()
            torch.cuda.current_stream().wait_stream(side)
            layer.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = step()
            graph.replay()
            torch.cuda.synchronize()
            replay_y = static_y.clone()
            replay_g = layer[0].weight.grad.clone()
            layer.zero_grad(set_to_none=True)
            eager_y = step()
            eager_g = layer[0].weight.grad
            same = rname not in ("delayed", "nvfp4")  # scales move / draws differ by design
            entry = {
                "captured": True,
                "finite": bool(torch.isfinite(replay_y).all() and torch.isfinite(replay_g).all()),
                "output_rel_diff": round(_rel_err(replay_y, eager_y.double()), 6),
                "wgrad_rel_diff": round(_rel_err(replay_g, eager_g.double()), 6),
            }
            if same:
                entry["bitwise_equal"] = bool(
                    torch.equal(replay_y, eager_y) and torch.equal(replay_g, eager_g)
                )
            result[rname] = entry
        except Exception as exc:  # noqa: BLE001 - what fails capture is the finding
            result[rname] = {"captured": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            torch.cuda.synchronize()
    return result


def _layer_step_out(
    layer: nn.Module, x: torch.Tensor, recipe: fc.Recipe
) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        with fc.autocast(recipe=recipe):
            y = layer(x)
        y.float().square().mean().backward()
        return y

    return step


# -- a Llama-style block --------------------------------------------------------------


class LlamaBlock(nn.Module):
    """Attention (q, k, v, o projections, causal SDPA) and a SwiGLU MLP, pre-norm."""

    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)
        q, k, v = (
            p(y).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        y = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


def llama(setup: Setup) -> dict:
    dev = setup.device
    hidden, heads, inter, seq = (256, 4, 704, 128) if setup.smoke else (4096, 32, 11008, 2048)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    base = LlamaBlock(hidden, heads, inter).to(dev, dtype)
    x = torch.randn(1, seq, hidden, device=dev, dtype=dtype, requires_grad=True)
    linear_params = sum(m.weight.numel() for m in base.modules() if isinstance(m, nn.Linear))
    flops = 6 * seq * linear_params + 12 * seq * seq * hidden / 2  # GEMMs + causal attention
    reps = 3 if setup.smoke else 10

    def step(model: nn.Module, recipe: fc.Recipe | None) -> None:
        with fc.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.float().square().mean().backward()

    def timed(model: nn.Module, recipe: fc.Recipe | None) -> float:
        return device_ms(setup, lambda: step(model, recipe), reps, warmup=3)

    def kernel_profile(model: nn.Module, recipe: fc.Recipe | None) -> dict[str, float]:
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        with profile(activities=activities) as prof:
            step(model, recipe)
            setup.sync()
        return kernel_time_table(device_kernels(prof.events()), 1, 10)

    bf16_ms = timed(base, None)
    result: dict[str, Any] = {
        "shape": f"hidden {hidden}, heads {heads}, mlp {inter}, seq {seq}, {dtype}",
        "bf16_ms": round(bf16_ms, 3),
        "bf16_TFLOPs": round(flops / bf16_ms / 1e9, 1),
        "bf16_top_kernels_us": kernel_profile(base, None),
    }
    for rname in TRAINING:
        model = fc.convert(copy.deepcopy(base))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ms = timed(model, RECIPES[rname])
            result[rname] = {"ms": round(ms, 3), "vs_bf16": round(ms / bf16_ms, 3)}
            if rname in ("current", "block"):  # where the time goes, by kernel
                result[rname]["top_kernels_us"] = kernel_profile(model, RECIPES[rname])
        except Exception as exc:  # noqa: BLE001
            result[rname] = f"{type(exc).__name__}: {str(exc)[:300]}"
        del model
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        result["torchao"] = "not installed"
        return result
    for name in ("tensorwise", "rowwise"):
        model = copy.deepcopy(base)
        try:
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(name))
            ms = timed(model, None)
            result[f"torchao_{name}"] = {"ms": round(ms, 3), "vs_bf16": round(ms / bf16_ms, 3)}
        except Exception as exc:  # noqa: BLE001
            result[f"torchao_{name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return result


PARTS: dict[str, Callable[[Setup], dict]] = {
    "env": env,
    "build": build,
    "parity": parity,
    "gemm": gemm,
    "bandwidth": bandwidth,
    "host_time": host_time,
    "profile": profile,
    "cuda_graph": cuda_graph,
    "llama": llama,
}


def main(argv: list[str]) -> int:
    parts, out = argv[0].split(","), Path(argv[1])
    smoke = "--smoke" in argv
    setup = Setup(device="cpu" if smoke else "cuda", smoke=smoke)
    for part in parts:
        start = time.perf_counter()
        line: dict[str, Any] = {"part": part}
        try:
            line["result"] = PARTS[part](setup)
        except Exception:  # noqa: BLE001 - recorded; the next part runs
            line["error"] = traceback.format_exc()[-4000:]
        line["seconds"] = round(time.perf_counter() - start, 1)
        with open(out / "sections.jsonl", "a") as handle:
            handle.write(json.dumps(line, default=str) + "\n")
        print(f"   {part}: {line['seconds']} s{' ERROR' if 'error' in line else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
