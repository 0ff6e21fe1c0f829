"""``python -m fastcast.kernels``: load the fused C++ kernels, building them where the
install did not (``make kernels`` runs it before the tests and benchmarks), and say where
they are and how long their build took."""

from __future__ import annotations

import sys

from . import build, installed


def install_origin(record: dict) -> str:
    """How the install got the library, from its record: built then (and how long that
    took), or copied from the kernel cache, where an earlier build left it."""
    if record.get("from_cache"):
        return f"copied at install from the kernel cache, {record.get('built_in', '?')}"
    return f"built at install in {record.get('seconds', '?')} s"


def main() -> int:
    """Load (or build) the CPU library, and the CUDA library where torch has CUDA and a
    GPU; exit status 1 with the reason when one does not build."""
    try:
        seconds = build.load()
    except build.BuildError as exc:
        print(f"fastcast: the fused kernels do not build here: {exc}", file=sys.stderr)
        return 1
    where = build.library_path()
    if installed.enabled() and where == str(installed.DIRECTORY / build.INSTALLED_LIBRARY):
        record = installed.record(build.INSTALLED_LIBRARY, build.INSTALLED_KEY) or {}
        print(
            f"fastcast: fused kernels installed in {installed.DIRECTORY} "
            f"({install_origin(record)}), loaded in {seconds:.2f} s"
        )
    else:
        print(f"fastcast: fused kernels ready in {build.build_dir()} ({seconds:.1f} s)")
    if not build.cuda_torch():
        return 0
    try:
        seconds = build.load_cuda()
    except build.BuildError as exc:
        print(f"fastcast: the CUDA kernels do not build here: {exc}", file=sys.stderr)
        return 1
    key = build.cuda_build_key()
    print(f"fastcast: CUDA kernels ready in {build.build_dir(key)} ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
