"""Running fastcast's CUDA path on a CPU-only torch, with fake tensors (issue 25, part A).

``FakeTensorMode`` makes CUDA tensors that carry shapes, dtypes and strides but no data,
and runs each operator's meta checks (``torch._scaled_mm``'s scale shapes and dtypes
included). Four things stand between that and a CPU-only build, and this module supplies
them:

- a device guard for CUDA (``fake_cuda_guard.cpp``, built once per machine), without
  which copies and autograd's graph abort the process;
- the capability answers (``simulated_cuda``): ``torch.cuda`` says a device of the given
  compute capability is there, and fastcast's caches are refreshed on the way in and out;
- the compiled (Inductor) quantize operators that CUDA tensors are routed to: their
  wrappers call the reference they would compile (Inductor cannot emit Triton here), and
  record each call, so tests see the routing and the count of operator launches;
- the backward pass: the autograd engine refuses a device it cannot access, so
  ``run_backward`` calls the graph's nodes in order itself, as the engine would.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd import Variable
from torch.utils._python_dispatch import TorchDispatchMode

from fastcast.kernels import choice
from fastcast.kernels import inductor as compiled
from fastcast.reference import hadamard
from fastcast.runtime import hardware

_GUARD_SOURCE = Path(__file__).with_name("fake_cuda_guard.cpp")
_guard_loaded = False


def register_cuda_guard() -> None:
    """Build (once per machine and torch version) and load the no-op CUDA device guard."""
    global _guard_loaded
    if _guard_loaded or torch.cuda.is_available():
        return
    from torch.utils.cpp_extension import load

    build = Path.home() / ".cache" / "fastcast" / f"fake-cuda-guard-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    load(
        "fastcast_fake_cuda_guard",
        [str(_GUARD_SOURCE)],
        build_directory=str(build),
        is_python_module=False,
    )
    _guard_loaded = True


@dataclass
class Launches:
    """What ran on the simulated device: compiled quantize operators by name, and the
    ``torch._scaled_mm`` calls with their operands' and scales' shapes and dtypes."""

    compiled_ops: list[str] = field(default_factory=list)
    scaled_mm: list[dict[str, Any]] = field(default_factory=list)
    host_syncs: list[str] = field(default_factory=list)
    # torch._scaled_grouped_mm calls, and the dtypes of torch._grouped_mm's operands.
    scaled_grouped_mm: list[dict[str, Any]] = field(default_factory=list)
    grouped_mm: list[torch.dtype] = field(default_factory=list)
    # Copies from host memory to the device (each a transfer the step would wait on).
    host_to_device: list[str] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self, launches: Launches) -> None:
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            a, b, scale_a, scale_b = args[:4]
            self.launches.scaled_mm.append(
                {
                    "a": (tuple(a.shape), a.dtype),
                    "b": (tuple(b.shape), b.dtype, tuple(b.stride())),
                    "scale_a": (tuple(scale_a.shape), scale_a.dtype),
                    "scale_b": (tuple(scale_b.shape), scale_b.dtype),
                    "out_dtype": kwargs.get("out_dtype", args[6] if len(args) > 6 else None),
                }
            )
        elif func is torch.ops.aten._scaled_mm_v2.default:  # F.scaled_mm (block scales)
            a, b, scales_a, recipe_a, _, scales_b, recipe_b = args[:7]
            self.launches.scaled_mm.append(
                {
                    "a": (tuple(a.shape), a.dtype),
                    "b": (tuple(b.shape), b.dtype, tuple(b.stride())),
                    "scale_a": (tuple(scales_a[0].shape), scales_a[0].dtype),
                    "scale_b": (tuple(scales_b[0].shape), scales_b[0].dtype),
                    "recipes": [list(recipe_a), list(recipe_b)],
                    "swizzles": [list(args[4]), list(args[7])],
                    "scales": [
                        [(tuple(t.shape), t.dtype) for t in s] for s in (scales_a, scales_b)
                    ],
                    "out_dtype": args[9] if len(args) > 9 else kwargs.get("out_dtype"),
                }
            )
        elif func is torch.ops.aten._scaled_grouped_mm.default:
            a, b, scale_a, scale_b = args[:4]
            self.launches.scaled_grouped_mm.append(
                {
                    "a": (tuple(a.shape), a.dtype),
                    "b": (tuple(b.shape), b.dtype),
                    "scale_a": (tuple(scale_a.shape), scale_a.dtype),
                    "scale_b": (tuple(scale_b.shape), scale_b.dtype),
                }
            )
        elif func is torch.ops.aten._grouped_mm.default:
            a, b = args[:2]
            self.launches.grouped_mm.append(a.dtype)
            if a.dtype == torch.float32 and isinstance(a, FakeTensor) and a.is_cuda:
                # The CUDA kernel runs FP32 on its fallback (a loop of mm over the groups,
                # their ends read on the host), which the meta function does not model:
                # the shapes of a bf16 call, in FP32.
                low = [x.to(torch.bfloat16) for x in (a, b)]
                return func(*low, *args[2:], **kwargs).float()
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            out = func(*args, **kwargs)
            if src.device.type == "cpu" and out.device.type == "cuda":
                self.launches.host_to_device.append(f"{str(func)} {tuple(src.shape)}")
            return out
        elif func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.launches.host_syncs.append(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated_cuda(
    capability: tuple[int, int], cuda_version: str = "12.9", triton: bool = True
) -> Iterator[Launches]:
    """A CUDA device of ``capability`` as far as torch.cuda and fastcast can tell, inside
    a ``FakeTensorMode`` (tensors made in the block are fake), with the compiled
    operators and ``torch._scaled_mm`` recording their calls."""
    register_cuda_guard()
    launches = Launches()

    def recording_compile(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            launches.compiled_ops.append(name)
            with torch.no_grad():
                return fn(*args)

        call.__name__ = call.__qualname__ = name  # as the real wrappers are named
        return call

    missing = None if triton else "triton is not importable (simulated)"
    # fastcast keeps the Hadamard matrix on each device in a process-wide cache, but
    # builds it afresh under a FakeTensorMode (a fake tensor must not outlive its mode):
    # here a cache of the simulation's own lifetime stands in for the process's, so a
    # second training step copies nothing from the host, as on a GPU.
    matrices: dict[Any, torch.Tensor] = {}
    real_rht_matrix = hadamard.rht_matrix

    def rht_matrix(signs: Any, device: Any = "cpu") -> torch.Tensor:
        key = (tuple(signs), str(device))
        if key not in matrices:
            matrices[key] = real_rht_matrix(signs, device)
        return matrices[key]

    patches = [
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: 1),
        mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: True),
        mock.patch.object(torch.cuda, "get_device_capability", lambda *a: capability),
        mock.patch.object(
            torch.cuda, "get_device_name", lambda *a: f"simulated sm{capability[0]}{capability[1]}"
        ),
        mock.patch.object(torch.version, "cuda", cuda_version),
        mock.patch.object(choice, "_triton_missing", lambda: missing),
        mock.patch.object(compiled, "_compile", recording_compile),
        mock.patch.object(compiled, "_ops", None),
        mock.patch.object(hadamard, "rht_matrix", rht_matrix),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        hardware.refresh()  # also the kernel choice
        try:
            with FakeTensorMode(), _Recorder(launches):
                yield launches
        finally:
            hardware.refresh()  # (patches still on: caches dropped before they go)
    hardware.refresh()


def on_fresh_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a new thread, its exception re-raised here. Per-thread state that
    outlives a call (delayed scaling's slabs of amax histories) then dies with the
    thread, rather than keep fake tensors past their FakeTensorMode."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def fake_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """Replace ``module``'s parameters by uninitialised fake CUDA ones of the same shapes
    and dtypes (inside ``FakeTensorMode``: ``.to('cuda')`` would need the real device)."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            fake = torch.empty(p.shape, dtype=p.dtype, device="cuda")
            setattr(sub, name, torch.nn.Parameter(fake, requires_grad=p.requires_grad))
    return module


def run_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` without the autograd engine: each node of the graph is
    called once all its consumers have given it their gradients (the engine's order),
    leaves accumulate into ``.grad``, and callbacks queued during the pass (delayed
    scaling's end of step) run at its end."""
    order: list[Any] = []
    seen: set[Any] = set()

    def visit(node: Any) -> None:  # post-order: a node after everything it feeds
        if node is None or node in seen:
            return
        seen.add(node)
        for nxt, _ in node.next_functions:
            visit(nxt)
        order.append(node)

    visit(output.grad_fn)
    # Gradients reaching each node, per output of its forward (a node of several
    # outputs, a split or a chunk, takes one gradient for each).
    pending: dict[Any, dict[int, list[torch.Tensor]]] = {output.grad_fn: {0: [grad]}}
    callbacks: list[Any] = []

    class _Engine:
        def queue_callback(self, fn: Any) -> None:
            callbacks.append(fn)

    with mock.patch.object(Variable, "_execution_engine", _Engine()):
        for node in reversed(order):
            received = pending.pop(node, None)
            if received is None:
                continue
            grads: list[Any] = []
            for index in range(max(len(getattr(node, "_input_metadata", ())), 1)):
                parts = received.get(index)
                total = None
                for part in parts or ():
                    total = part if total is None else total + part
                grads.append(total)
            variable = getattr(node, "variable", None)
            if variable is not None:  # AccumulateGrad
                g = grads[0]
                variable.grad = g if variable.grad is None else variable.grad + g
                continue
            outs = node(*grads) if callable(node) else node.apply(*grads)
            outs = outs if isinstance(outs, tuple) else (outs,)
            for (nxt, input_nr), out in zip(node.next_functions, outs):
                if nxt is not None and out is not None:
                    pending.setdefault(nxt, {}).setdefault(input_nr, []).append(out)
        for fn in callbacks:
            fn()
