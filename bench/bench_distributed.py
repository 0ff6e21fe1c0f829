"""Bytes on the wire of FSDP2's all-gathers, by recipe: the quantized all-gather of
``fc.convert(..., quantized_all_gather=True)`` (codes and scales) against FSDP2's
high-precision gathers.

Two gloo ranks on the CPU, ``LAYERS`` blocks ``HIDDEN -> FFN -> HIDDEN`` of ``fc.Linear``
(with biases), each layer ``fully_shard``-ed. The bytes are counted from the payloads FSDP2
hands ``torch.distributed.all_gather_single`` (what each rank sends; the wire carries
``world - 1`` times that to the others), for the forward and the backward (the re-gather
of ``reshard_after_forward=True``) of one training step. The step times are the CPU's
and gloo's, printed for completeness only: they say nothing about NCCL on GPUs.

Memory per rank (Linux): the ranks run with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 64 KiB,
so every tensor buffer above it is its own mapping, returned at its free, and the
process's resident set follows the live buffers. ``peak MB``: the high-water mark of the
resident set during one step (``/proc/self/clear_refs`` resets it) above the resident
set before it: gathered weights, activations, gradients, to within the ~1-2 MB of
Python objects and small buffers a step touches. ``growth MB``: resident set after step
``STEPS + MEMORY_STEPS`` minus after step ``STEPS + 1`` (0 within that noise: no leak).

``python -m bench.bench_distributed`` prints the table.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastcast as fc

WORLD, LAYERS, HIDDEN, FFN, TOKENS, STEPS = 2, 2, 512, 2048, 256, 3
MEMORY_STEPS = 20  # after the timed ones

# name -> (recipe for fc.convert and the autocast, quantized_all_gather, param dtype)
CONFIGS: dict[str, tuple[Any, bool, torch.dtype]] = {
    "fp32 gather (current)": (fc.Float8CurrentScaling(), False, torch.float32),
    "bf16 gather (current)": (fc.Float8CurrentScaling(), False, torch.bfloat16),
    "fp8 gather, current": (fc.Float8CurrentScaling(), True, torch.float32),
    "fp8 gather, delayed": (fc.DelayedScaling(), True, torch.float32),
    "fp8 gather, current, bf16 params": (fc.Float8CurrentScaling(), True, torch.bfloat16),
    "fp8 gather, rowwise": (fc.Float8RowwiseScaling(), True, torch.float32),
    "fp8 gather, block 128x128": (fc.Float8BlockScaling(), True, torch.float32),
    "fp8 gather, mxfp8": (fc.MXFP8BlockScaling(), True, torch.float32),
    "fp4 gather, nvfp4": (fc.NVFP4BlockScaling(), True, torch.float32),
    "fp4 gather, nvfp4, bf16 params": (fc.NVFP4BlockScaling(), True, torch.bfloat16),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN)]
    return nn.Sequential(*layers)


def _status(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return 1024.0 * int(line.split()[1])
    return float("nan")


def _memory(step: Any) -> tuple[float, float]:
    """(peak, growth) bytes over ``MEMORY_STEPS`` calls of ``step(seed)``: see the module
    docstring. NaN where ``/proc`` is not Linux's."""
    if not os.path.exists("/proc/self/clear_refs"):
        return float("nan"), float("nan")
    after = []
    peak = 0.0
    for i in range(MEMORY_STEPS):
        gc.collect()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        step(STEPS + i)
        peak = max(peak, _status("VmHWM") - before)
        gc.collect()
        after.append(_status("VmRSS"))
    return peak, after[-1] - after[0]


def _run(config: str) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    recipe, quantized, param_dtype = CONFIGS[config]
    model = fc.convert(_model(), recipe=recipe, quantized_all_gather=quantized, keep_head=False)
    mesh = init_device_mesh("cpu", (WORLD,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for m in model:
        if isinstance(m, fc.Linear):
            fully_shard(m, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sent = {"forward": 0, "backward": 0}
    phase = ["forward"]
    orig = dist.all_gather_single

    def counting(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:  # noqa: A002
        sent[phase[0]] += input.numel() * input.element_size()
        return orig(output, input, group=group, async_op=async_op)

    def step(seed: int) -> None:
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))
        phase[0] = "forward"
        with fc.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss = model(x).float().square().mean()
        phase[0] = "backward"
        loss.backward()
        opt.step()
        opt.zero_grad()

    dist.all_gather_single = counting
    try:
        times = []
        for seed in range(STEPS):
            sent.update(forward=0, backward=0)
            start = time.perf_counter()
            step(seed)
            times.append(time.perf_counter() - start)
        counted = {k: float(v) for k, v in sent.items()}
    finally:
        dist.all_gather_single = orig
    peak, growth = _memory(step)
    return {**counted, "ms": 1e3 * min(times), "peak": peak, "growth": growth}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results = {config: _run(config) for config in CONFIGS}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


def measure() -> dict[str, dict[str, float]]:
    """Per configuration: forward and backward all-gather bytes per rank and step, the
    best step time (ms), and rank 0's step memory (peak and growth, bytes)."""
    from fastcast.kernels import build  # noqa: PLC0415

    build.load()  # once here, not in each rank
    # Read by glibc when each spawned rank starts: large buffers mapped one by one.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "pg"), tmp), nprocs=WORLD)
        return torch.load(os.path.join(tmp, "results.pt"), weights_only=True)


def main() -> None:
    results = measure()
    fp32 = results["fp32 gather (current)"]["forward"]
    bf16 = results["bf16 gather (current)"]["forward"]
    print(
        f"FSDP2 all-gather bytes per rank and step: {WORLD} gloo ranks, {LAYERS} x "
        f"({HIDDEN}->{FFN}->{HIDDEN}) fc.Linear with biases, {TOKENS} tokens"
    )
    columns = ("forward B", "backward B", "fwd/fp32", "fwd/bf16", "bwd/fp32", "step ms",
               "peak MB", "growth MB")  # fmt: skip
    print(f"{'configuration':36} " + " ".join(f"{c:>10}" for c in columns))
    for config, r in results.items():
        print(
            f"{config:36} {r['forward']:10.0f} {r['backward']:10.0f} "
            f"{r['forward'] / fp32:10.3f} {r['forward'] / bf16:10.3f} "
            f"{r['backward'] / fp32:10.3f} {r['ms']:10.1f} {r['peak'] / 2**20:10.1f} "
            f"{r['growth'] / 2**20:10.1f}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
