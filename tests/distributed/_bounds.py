"""How far two FP32 computations of one sum may differ when they add its terms in another
order: the bounds the distributed and compiled-vs-eager tests compare with where the two
sides run different code (another reduction order, another GEMM kernel).

Two orders of an n-term FP32 sum each differ from the exact sum by at most (n - 1) U times
the sum of the terms' magnitudes (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., eq. 4.4), so from each other by at most twice that. The tests take
it relative to the result's norm: their terms do not cancel much (the measured
differences sit 100x or more below the bound), and a quantization code on the other side
of an FP8 rounding midpoint (one FP8 step: 2**-4 or more of the element) still fails it.
Which kernel a CPU runs, and so which order, depends on its vector instructions (MKL's
GEMM kernels, ATen's cascade sums): a bitwise comparison holds only where both sides run
the same code.
"""

from __future__ import annotations

import torch

U = 2.0**-24  # FP32's unit roundoff


def sum_orders_bound(terms: int) -> float:
    """Relative difference allowed between two orders of a ``terms``-term FP32 sum."""
    return 2 * (terms - 1) * U


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms); 0 for two zero tensors."""
    d = (a - b).norm().item()
    return d / b.norm().item() if d else 0.0


def assert_sum_rounding(a: torch.Tensor, b: torch.Tensor, terms: int, what: object) -> None:
    """``a`` equals ``b`` within two orders of a ``terms``-term FP32 sum."""
    assert a.shape == b.shape, what
    rel = rel_diff(a, b)
    assert rel <= sum_orders_bound(terms), (what, rel, sum_orders_bound(terms))
