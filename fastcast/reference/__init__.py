"""The reference math: every quantization and decode in plain PyTorch operations.

This is the definition every other path is checked against (the fused C++ operators,
the Inductor-compiled ones CUDA runs, the tests' float64 references) and the fallback
when none of them is to be had. It is the bottom layer: it imports torch and
``fastcast.formats`` only, so the quantizers, the tensors and the kernels can all use it.
"""
