"""``QuantizedColwiseParallel``: ``ColwiseParallel`` whose sequence-sharded input an
``fc.Linear`` all-gathers in FP8.

torch's ``ColwiseParallel(input_layouts=Shard(1))`` all-gathers the input in high
precision in its forward pre-hook, before the layer runs. This style is the same in
everything (weight and bias ``Shard(0)``, output ``Shard(-1)`` or ``output_layouts``),
except that on an ``fc.Linear`` inside an enabled ``fc.autocast`` with a per-tensor recipe
it hands the layer the rank's slice as a ``Shard`` DTensor; the layer then casts the slice
to FP8 with the global scale and all-gathers the codes (``fastcast.nn.sequence_parallel``,
which also lists the inputs it still gathers in high precision). Anywhere else (another
recipe, outside autocast, another module type) it gathers as ``ColwiseParallel`` does.
The results are those of ``ColwiseParallel``, bit for bit; only the bytes on the wire
differ (a quarter of an FP32 gather, half of a BF16 one).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel

from ..nn.linear import Linear
from ..nn.sequence_parallel import PER_TENSOR
from ..runtime.state import get_stack

__all__ = ["QuantizedColwiseParallel"]


class QuantizedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` (same arguments) for ``fc.Linear`` layers with a sequence-sharded
    input: the all-gather of the input carries FP8 codes under per-tensor recipes
    (``Float8CurrentScaling``, ``DelayedScaling``); see the module docstring. Use it in a
    ``parallelize_module`` plan where ``ColwiseParallel(input_layouts=Shard(1))`` would go.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Linear):  # nn.Linear, nn.Embedding: as ColwiseParallel
            return super()._apply(module, device_mesh)
        return distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            partial(self._prepare_slice_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    @staticmethod
    def _prepare_slice_fn(
        input_layouts: tuple[Any, ...],
        desired_input_layouts: tuple[Any, ...],
        mod: nn.Module,
        inputs: tuple[Any, ...],
        device_mesh: DeviceMesh,
    ) -> DTensor:
        """``ColwiseParallel``'s input hook, leaving a sequence-sharded input sharded when
        the layer will gather it in FP8 (it gathers in high precision where it cannot)."""
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
        if tuple(x.placements) == tuple(desired_input_layouts):
            return x
        if _gathered_by_layer(x):
            return x
        return x.redistribute(placements=desired_input_layouts, async_op=True)


def _gathered_by_layer(x: DTensor) -> bool:
    """Whether the ``fc.Linear`` will gather ``x`` itself (in FP8): a per-tensor recipe's
    enabled autocast and a sequence-sharded input (the layer checks the rest)."""
    frame = get_stack()[0]
    if not frame.enabled or not isinstance(frame.recipe, PER_TENSOR):
        return False
    if len(x.placements) != 1 or torch.compiler.is_compiling():
        return False
    placement = x.placements[0]
    return isinstance(placement, Shard) and placement.dim % x.dim() != x.dim() - 1
