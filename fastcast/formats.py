"""Element formats, defined once: their names, largest finite values and torch dtypes, and
the E2M1 (FP4) code values. Recipes, quantizers, tensors, kernels and the checkpoint codec
all read them here."""

from __future__ import annotations

import torch

# Largest finite magnitude of each element format.
ELEMENT_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}

# The FP8 formats, in the order the checkpoint codec numbers them, and their dtypes.
FP8_FORMATS = ("e4m3", "e5m2")
FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# E2M1 magnitudes by 3-bit code (the fourth bit is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

FP32_MAX = torch.finfo(torch.float32).max
