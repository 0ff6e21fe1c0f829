"""``QuantizedColwiseParallel``: ``ColwiseParallel`` whose sequence-sharded input an
``fc.Linear`` all-gathers quantized (FP8 or FP4 codes and their scales).

torch's ``ColwiseParallel(input_layouts=Shard(1))`` all-gathers the input in high
precision in its forward pre-hook, before the layer runs. This style is the same in
everything (weight and bias ``Shard(0)``, output ``Shard(-1)`` or ``output_layouts``),
except that on an ``fc.Linear`` it hands the layer the rank's slice as a ``Shard`` DTensor,
and the layer gathers it: inside an enabled ``fc.autocast`` it quantizes the slice as
one process quantizes the whole input and all-gathers the codes and scales (per-tensor,
row-wise, block, MXFP8 and NVFP4 recipes; the weight gradient's column-wise layout is
gathered again in backward where it scales along the tokens:
``fastcast.nn.sequence_parallel``, which also lists the inputs it still gathers in high
precision); anywhere else (``CustomRecipe``, outside autocast) in high precision, as
``ColwiseParallel`` does. On another module type it is ``ColwiseParallel``. The results
are those of ``ColwiseParallel``, bit for bit; only the bytes on the wire differ (the
forward gather: 0.25x of an FP32 gather for per-tensor FP8, 0.258x for the other FP8
recipes with their scales, 0.14x for NVFP4).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel

__all__ = ["QuantizedColwiseParallel"]


class QuantizedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` (same arguments) for ``fc.Linear`` layers with a sequence-sharded
    input: the all-gather of the input carries quantized codes (and scales) under every
    built-in recipe but ``Float8RowwiseScaling(wgrad_high_precision=True)``; see the
    module docstring. Use it in a ``parallelize_module`` plan where
    ``ColwiseParallel(input_layouts=Shard(1))`` would go.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # fc.Linear (and fc.Conv1D) gather their input themselves; nn.Linear, nn.Embedding
        # get ColwiseParallel's gather. (An attribute, not the class: nn is the layer above.)
        if not getattr(module, "fc_gathers_sharded_input", False):
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
        """``ColwiseParallel``'s input hook without the redistribution: the ``fc.Linear``
        gathers its input itself, in FP8 where it can, else in high precision. (Deciding
        in the layer rather than here keeps an activation-checkpointed recomputation,
        which replays the original call's autocast, doing what the original did.)"""
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
        return x
