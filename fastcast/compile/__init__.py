"""``torch.compile`` support: Dynamo polyfills (``torch.compiler.substitute_in_graph``)
that give traced code its own versions of a few eager functions. Eager calls the
originals and pays nothing; importing this package registers the polyfills
(``fastcast._on_import`` does that when ``torch._dynamo`` is imported).

- ``stack``: the autocast stack as Dynamo sees it (guards on the recipe, per thread);
- ``plans``: a fresh plan per trace, the weight quantized in the graph, refusals;
- ``delayed``: DelayedScaling in a compiled model under an eager autocast;
- ``fusion``: the FP8 cast, the CPU GEMM choice and the fused-kernel choice written the
  way Inductor fuses best (the same values as eager).
"""

from . import delayed, fusion, plans, stack

__all__ = ["delayed", "fusion", "plans", "stack"]
