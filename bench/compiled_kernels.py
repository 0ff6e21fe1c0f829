"""What the Inductor-compiled quantize operators (``fastcast.kernels.inductor``: CUDA's
kernels, and every device's under ``FASTCAST_KERNELS=compiled``) cost to compile, in a
first process (empty Inductor cache) and in a second one (the cache on disk warm).

Each process calls every operator once on the CPU (one intra-op thread), as a 256x384
FP32 ``fc.Linear`` input would (both layouts where the recipe makes them), timing that
first call (trace and compile, or trace and cache load), then the median of warm calls.

    PYTHONPATH=. python -m bench.compiled_kernels
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROWS, COLS = 256, 384


def _calls() -> dict[str, object]:
    import torch  # noqa: PLC0415 - in the measured process only

    from fastcast.kernels import inductor as compiled  # noqa: PLC0415

    torch.set_num_threads(1)  # as the other benchmarks; also steadier on a shared machine
    ops = compiled.ops()
    x = torch.randn(ROWS, COLS)
    e4m3 = torch.float8_e4m3fn
    codes = x.to(e4m3)
    slot = torch.zeros(1)
    return {
        "quantize_tensorwise": lambda: ops["quantize_tensorwise"](
            x, None, e4m3, False, 0.0, True, False
        ),
        "record_amax": lambda: ops["record_amax"](slot, x),
        "quantize_blocks": lambda: ops["quantize_blocks"](x, 1, e4m3, True, 0.0),
        "quantize_blocks (x.t())": lambda: ops["quantize_blocks"](x.t(), 1, e4m3, True, 0.0),
        "quantize_mxfp8": lambda: ops["quantize_mxfp8"](x, e4m3, False),
        "quantize_nvfp4": lambda: ops["quantize_nvfp4"](x, False, True, True, False, None, None),
        "dequantize_blocks": lambda: ops["dequantize_blocks"](
            codes, torch.ones(ROWS, COLS // 128), 1, 128
        ),
    }


def measure() -> dict[str, tuple[float, float]]:
    """Per operator: the first call's seconds and the warm calls' median seconds."""
    out = {}
    for name, call in _calls().items():
        start = time.perf_counter()
        call()
        first = time.perf_counter() - start
        times = []
        for _ in range(50):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[name] = (first, statistics.median(times))
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        runs = []
        for _ in ("cold", "warm"):
            start = time.perf_counter()
            child = subprocess.run(
                [sys.executable, "-m", "bench.compiled_kernels", "--child"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            runs.append((time.perf_counter() - start, json.loads(child.stdout)))
    (cold_s, cold), (warm_s, warm) = runs
    print(f"{ROWS}x{COLS} FP32 on the CPU, torch {_torch_version()}")
    print(f"{'operator':26s} {'first call, cold':>17s} {'warm cache':>11s} {'then per call':>14s}")
    for name in cold:
        print(
            f"{name:26s} {cold[name][0]:15.2f} s {warm[name][0]:9.2f} s"
            f" {warm[name][1] * 1e6:11.1f} us"
        )
    total_cold, total_warm = (sum(v[0] for v in r.values()) for r in (cold, warm))
    print(f"{'all first calls':26s} {total_cold:15.2f} s {total_warm:9.2f} s")
    print(f"whole process (imports included): cold {cold_s:.1f} s, warm {warm_s:.1f} s")


def _torch_version() -> str:
    import torch  # noqa: PLC0415

    return torch.__version__


if __name__ == "__main__":
    if "--child" in sys.argv:
        print(json.dumps(measure()))
    else:
        main()
