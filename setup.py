"""The compiled pieces of the install: fc.autocast's hot path in C, and the fused CPU
quantize kernels (fastcast/kernels/csrc) built against the torch of the environment
fastcast is installed into.

Everything else is in pyproject.toml. Both are optional: without a C compiler the
install still succeeds, fc.autocast runs its Python methods (the reference) instead, and
the kernels build on first use (or the PyTorch reference runs) as they do for a torch
other than the one they were built against. ``FASTCAST_BUILD_KERNELS=0`` skips the
kernels' build at install.

Which torch: the one the installing Python imports. pip's build isolation (the default)
hides the environment's packages from this script, so the kernels are built in a child
of the same Python with that isolation undone: the torch the library will be loaded
next to, never one downloaded for the build (a CUDA user would get another torch, and
a library that does not load). ``pip install --no-build-isolation .`` builds against
the build environment's torch directly. Where no torch is installed yet, the kernels
build on first use. ``pip install -v`` shows the build's lines and its time.
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
KERNELS = ("fastcast", "kernels")


def _child_module():
    """fastcast/kernels/_child.py (standard library only), loaded by path."""
    spec = importlib.util.spec_from_file_location(
        "_fastcast_child", HERE.joinpath(*KERNELS, "_child.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _say(message: str) -> None:
    print(f"fastcast: {message}", file=sys.stderr, flush=True)


def build_kernels(dest: Path) -> bool:
    """Build the CPU kernels into ``dest`` (``_jobs.install_into``); False, said, when
    they are not built here."""
    if os.environ.get("FASTCAST_BUILD_KERNELS", "1").strip() == "0":
        _say("FASTCAST_BUILD_KERNELS=0: the fused kernels are not built at install")
        return False
    child = _child_module()
    start = time.perf_counter()
    env = child.environment(os.environ)
    if not child.has_torch(env, HERE):  # pip's isolated build environment: undo it
        env = child.environment(os.environ, drop=child.ISOLATION_VARIABLES)
        if not child.has_torch(env, HERE):
            _say(
                "torch is not installed where fastcast is being installed: the fused "
                "kernels will build on first use (or run `python -m fastcast.kernels`)"
            )
            return False
    done = child.run(["install", str(dest)], env, cwd=HERE, capture=False)
    if done.returncode != 0:
        _say(
            "the fused kernels did not build at install (see above): they will build on "
            "first use, or the PyTorch reference runs"
        )
        return False
    _say(f"fused kernels installed in {time.perf_counter() - start:.1f} s ({dest})")
    return True


class BuildExtWithKernels(build_ext):
    """build_ext, then the fused kernels into ``fastcast/kernels/installed/`` of the
    build (a wheel, a regular install) or of the source tree (an editable install)."""

    def _kernels_dest(self) -> Path:
        if self.inplace:
            package = self.get_finalized_command("build_py").get_package_dir(".".join(KERNELS))
            return HERE / package / "installed"
        return Path(self.build_lib).joinpath(*KERNELS, "installed")

    def run(self):
        super().run()
        build_kernels(self._kernels_dest())

    def get_outputs(self):
        dest = self._kernels_dest()
        built = [dest / name for name in ("fastcast_kernels.so", "key.json")]
        return [*super().get_outputs(), *(str(p) for p in built if p.exists())]


setup(
    ext_modules=[
        Extension(
            "fastcast.runtime._native",
            sources=["fastcast/runtime/_native.c"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExtWithKernels},
)
