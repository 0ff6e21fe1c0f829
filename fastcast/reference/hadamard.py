"""The random Hadamard transform (RHT) of NVFP4's weight-gradient operands.

``M = diag(signs) @ H / 4`` with ``H`` the 16x16 Sylvester Hadamard matrix (entries
+-1) and ``signs`` a fixed vector of +-1: ``M`` is orthogonal, so transforming both
operands of a GEMM block-wise along its reduction dimension leaves the product unchanged
in exact arithmetic, ``(A M)(B M)^T = A M M^T B^T = A B^T``, while spreading an outlier
over its 16-element block before quantization. As in TransformerEngine, a row ``v`` of 16
consecutive elements along the reduction dimension becomes ``v @ M``.

The default sign vector is TransformerEngine's hard-coded one
(``get_wgrad_sign_vector``), so the transform is the same in every run, process and
device; ``seed`` draws another one from a CPU ``torch.Generator`` seeded with it, which is
reproducible across runs, processes and devices as well.
"""

from __future__ import annotations

import functools

import torch

SIZE = 16

# TransformerEngine's fixed sign vector of the weight-gradient RHT (its
# ``get_wgrad_sign_vector``, transformer_engine/pytorch/tensor/nvfp4_tensor.py).
TE_SIGNS: tuple[int, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def sign_vector(seed: int | None = None) -> tuple[int, ...]:
    """The 16 signs of the transform: TE's fixed vector, or one drawn from ``seed``."""
    if seed is None:
        return TE_SIGNS
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"fastcast.reference.hadamard: seed must be an int or None, got {seed!r}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    bits = torch.randint(0, 2, (SIZE,), generator=gen)
    return tuple(int(b) * 2 - 1 for b in bits)


def hadamard_matrix() -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix (+-1 entries, float64): ``H[i, j] =
    (-1)^popcount(i & j)``."""
    idx = torch.arange(SIZE)
    parity = torch.zeros(SIZE, SIZE, dtype=torch.int64)
    both = idx[:, None] & idx[None, :]
    for bit in range(4):
        parity += (both >> bit) & 1
    return (1 - 2 * (parity % 2)).to(torch.float64)


def _build(signs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Every entry is +-0.25: exact in FP32.
    signs_t = torch.tensor(signs, dtype=torch.float64)
    return (signs_t[:, None] * hadamard_matrix() / 4).to(torch.float32).to(device)


# A process-wide cache of an immutable fact (the FP32 matrix of a sign vector on a
# device); callers never write to it.
_matrix = functools.cache(_build)


def check_signs(signs: tuple[int, ...]) -> None:
    """A ValueError unless ``signs`` is a sign vector: ``SIZE`` values of +-1."""
    if len(signs) != SIZE or any(s not in (1, -1) for s in signs):
        raise ValueError(
            f"fastcast.reference.hadamard: signs must be {SIZE} values of +-1, got {signs!r}"
        )


def rht_matrix(signs: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """``diag(signs) @ H / 4`` as FP32 (16x16) on ``device``: read only."""
    check_signs(signs)
    if torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None:
        # Traced: a constant of the graph. A fake tensor must not outlive its trace (or
        # its FakeTensorMode) in the process-wide cache.
        return _build(tuple(signs), torch.device(device))
    return _matrix(tuple(signs), torch.device(device))


def transform_columns(
    x: torch.Tensor, signs: tuple[int, ...], inverse: bool = False
) -> torch.Tensor:
    """``x`` ``[R, K]`` (R a multiple of 16) with every column transformed in blocks of 16
    rows: the rows of ``x.t()`` become ``v @ M`` (``v @ M^T`` with ``inverse``). FP32 out,
    computed in FP32 (each output a 16-term sum of products by +-0.25)."""
    rows, cols = x.shape
    if rows % SIZE:
        raise ValueError(
            f"fastcast.reference.hadamard: the transformed dimension ({rows}) must be a "
            f"multiple of {SIZE}"
        )
    m = rht_matrix(signs, x.device)
    # Column blocks [R/16, 16, K]: (v @ M) for each column v of a block is M^T @ block.
    blocks = x.float().reshape(rows // SIZE, SIZE, cols)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):  # it would run the product in 16 bits
        with torch.autocast(device_type, enabled=False):
            out = torch.matmul(m if inverse else m.t(), blocks)
    else:
        out = torch.matmul(m if inverse else m.t(), blocks)
    return out.reshape(rows, cols)


def transform_rows(x: torch.Tensor, signs: tuple[int, ...], inverse: bool = False) -> torch.Tensor:
    """``x`` ``[R, K]`` (K a multiple of 16) with every row transformed in blocks of 16
    elements: ``v @ M`` (``v @ M^T`` with ``inverse``). FP32 out."""
    return transform_columns(x.t(), signs, inverse).t()
