"""The widening functions of ``csrc/element.h`` that only the CUDA kernels call (the CPU
operators widen through c10's tables), compiled for the host: every E4M3 and E5M2 byte
(``fp8_to_float``, what ``dequantize_blocks`` reads) and every E2M1 code (``e2m1_value``,
``dequantize_nvfp4``) against torch's own widening and ``formats.E2M1_VALUES``. The
functions are bit manipulation and exact products, so the host's result is the GPU's.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from fastcast.formats import E2M1_VALUES
from fastcast.kernels import build

PROGRAM = r"""
#include <cstdio>
#include "element.h"
using namespace fastcast;
int main() {
  for (int b = 0; b < 256; ++b) std::printf("%08x\n", bits_of(fp8_to_float<true>(b)));
  for (int b = 0; b < 256; ++b) std::printf("%08x\n", bits_of(fp8_to_float<false>(b)));
  for (int c = 0; c < 16; ++c) std::printf("%08x\n", bits_of(e2m1_value(c)));
}
"""


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> dict[str, torch.Tensor]:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    directory = tmp_path_factory.mktemp("element-decode")
    source, program = directory / "decode.cpp", directory / "decode"
    source.write_text(PROGRAM)
    subprocess.run(
        [compiler, "-O2", "-std=c++17", f"-I{build.CSRC}", str(source), "-o", str(program)],
        check=True,
        capture_output=True,
    )
    out = subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout
    words = torch.tensor([int(w, 16) for w in out.split()], dtype=torch.int64)
    values = words.to(torch.int32).view(torch.float32)  # the low 32 bits, as FP32
    return {
        "e4m3": values[:256],
        "e5m2": values[256:512],
        "e2m1": values[512:],
    }


def assert_bits(got: torch.Tensor, want: torch.Tensor, nan_payload: bool) -> None:
    """Equal FP32 bits; with nan_payload False, a NaN needs only be NaN of the same sign."""
    g, w = got.view(torch.int32), want.view(torch.int32)
    same = g == w
    if not nan_payload:
        same |= got.isnan() & want.isnan() & ((g < 0) == (w < 0))
    bad = (~same).nonzero().reshape(-1)
    assert bad.numel() == 0, [(int(i), hex(int(g[i])), hex(int(w[i]))) for i in bad[:5]]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_fp8_byte_widens_as_torch_does(decoded, fmt):
    dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    assert_bits(decoded[fmt], want, nan_payload=False)
    assert int(decoded[fmt].isnan().sum()) == (2 if fmt == "e4m3" else 6)


def test_every_e2m1_code_has_its_value(decoded):
    want = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float32)
    assert_bits(decoded["e2m1"], want, nan_payload=True)  # code 8 is -0.0
