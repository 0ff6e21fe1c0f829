"""Runs a kernel build in a child Python process, with its environment passed explicitly.

``cpp_extension`` finds ``ninja`` on ``PATH``. The ``ninja`` wheel (a dependency) puts it
in the environment's ``bin`` directory, which is not on ``PATH`` when the environment's
Python runs without being activated; the child gets a ``PATH`` that holds it, and no
process's ``os.environ`` is written (a library must not change its user's environment,
which other threads read). The child imports ``_jobs`` and ``build`` from their folder,
so this works before fastcast is importable: ``setup.py`` builds the kernels at install
through it.

Standard library only (``setup.py`` loads this file by path, possibly without torch).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

KERNELS = Path(__file__).parent
# What the child runs: ``_jobs.child_main`` with the job's arguments, imported from this
# folder as a package of its own, without ``import fastcast`` (which an install in
# progress does not have, and which would import far more than a build needs).
CHILD = (
    "import importlib, sys, types\n"
    "package = types.ModuleType('_fastcast_kernels')\n"
    "package.__path__ = [sys.argv[1]]\n"
    "sys.modules[package.__name__] = package\n"
    "jobs = importlib.import_module('_fastcast_kernels._jobs')\n"
    "sys.exit(jobs.child_main(sys.argv[2:]))\n"
)
# pip's build isolation hides the environment's own site-packages with these two (its
# PYTHONPATH holds a sitecustomize that removes them from sys.path).
ISOLATION_VARIABLES = ("PYTHONPATH", "PYTHONNOUSERSITE")


def ninja_dir(path: str | None) -> str | None:
    """The ``ninja`` wheel's bin directory when ``path`` (a ``PATH`` value) has no ninja."""
    if shutil.which("ninja", path=path) is not None:
        return None
    with contextlib.suppress(ImportError):
        import ninja  # noqa: PLC0415 - only to locate the executable

        return str(ninja.BIN_DIR)
    return None


def environment(base: Mapping[str, str], drop: Sequence[str] = ()) -> dict[str, str]:
    """``base`` without the ``drop`` variables, with ninja's directory added to ``PATH``
    where ``PATH`` has no ninja."""
    env = {k: v for k, v in base.items() if k not in drop}
    extra = ninja_dir(env.get("PATH"))
    if extra is not None:
        env["PATH"] = os.pathsep.join((extra, env["PATH"])) if env.get("PATH") else extra
    return env


def run(
    args: Sequence[str], env: Mapping[str, str], cwd: Path, capture: bool = True
) -> subprocess.CompletedProcess:
    """``_jobs.child_main(args)`` in a child of this interpreter (no timeout: a build on a
    busy machine takes many minutes)."""
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(KERNELS), *args],
        env=dict(env),
        cwd=cwd,
        capture_output=capture,
        text=True,
        check=False,
    )


def has_torch(env: Mapping[str, str], cwd: Path) -> bool:
    """Whether this interpreter imports torch with ``env``."""
    done = subprocess.run(
        [sys.executable, "-c", "import torch"], env=dict(env), cwd=cwd, capture_output=True
    )
    return done.returncode == 0


def tail(text: str, limit: int = 3000) -> str:
    """The end of a child's output, where its error is."""
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]
