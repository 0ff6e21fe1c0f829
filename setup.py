"""The one compiled piece of the install: fc.autocast's hot path in C.

Everything else is in pyproject.toml. ``optional=True``: without a C compiler the install
still succeeds, and fc.autocast runs its Python methods (the reference) instead. The
fused quantize kernels are not built here; they build on first use (fastcast/kernels).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fastcast.runtime._native",
            sources=["fastcast/runtime/_native.c"],
            optional=True,
        )
    ]
)
