"""One build directory: its cross-process lock (``fcntl.flock``, released by the OS if the
holder dies), the sources copied into it (so that installs at different paths run the
same build commands), the compile in a child process, and the ``built`` stamp. A library
whose directory holds the stamp is complete and is never relinked.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from .sources import BUILT_STAMP, CSRC, HEADERS, LOCK_FILE, NAMESPACE, SOURCES


class BuildError(RuntimeError):
    """The C++ operators could not be built or loaded."""


def say(message: str) -> None:
    """A line on stderr: the build stalls the first quantize for tens of seconds, which
    must be visible without any logging set-up."""
    print(f"fastcast: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def exclusive(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s lock (across processes; the OS releases it if the holder
    dies), saying so when another process has it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process that is building the fused kernels in {directory}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def build_step(what: str, directory: Path, key: dict[str, str]) -> Iterator[None]:
    """Around one library's compile (the caller holds the directory's lock): the time it
    took said on stderr, and the ``built`` stamp once it succeeded."""
    start = time.perf_counter()
    try:
        # torch's own lock file: left behind by a build that was killed, it would make
        # cpp_extension wait forever. Nobody else is building here: we hold the lock.
        (directory / "lock").unlink(missing_ok=True)
        yield
    except Exception:
        say(f"building the {what} failed after {time.perf_counter() - start:.1f} s")
        raise
    (directory / BUILT_STAMP).write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
    say(f"built the {what} in {time.perf_counter() - start:.1f} s")


def compile_in_child(kind: str, directory: Path, *args: str) -> None:
    """Compile library ``kind`` (``child_main``) into ``directory`` in a child process
    whose environment is this one's with ninja on ``PATH`` (``_child``); ``BuildError``
    with the end of its output when it fails."""
    from . import _child  # noqa: PLC0415 - not in a build's child (no package)

    env = _child.environment(os.environ)
    done = _child.run([kind, str(directory), *args], env, cwd=directory)
    if done.returncode != 0:
        raise BuildError(_child.tail(done.stderr + done.stdout))


def copy_sources(
    target: Path,
    sources: tuple[Path, ...] = SOURCES,
    headers: tuple[Path, ...] = HEADERS,
) -> list[Path]:
    """The sources and headers copied into ``target`` at their paths under ``csrc/`` (the
    sources' paths returned): ninja's commands name them there, the same for every
    install, and ``#include "../element.h"`` finds its file. A copy is written only when
    it differs, so ninja sees no newer file on a later build."""
    for source in (*sources, *headers):
        text = source.read_bytes()
        copy = target / source.relative_to(CSRC)
        copy.parent.mkdir(parents=True, exist_ok=True)
        if not copy.exists() or copy.read_bytes() != text:
            partial = copy.with_suffix(copy.suffix + ".partial")
            partial.write_bytes(text)
            os.replace(partial, copy)
    return [target / s.relative_to(CSRC) for s in sources]


def import_library(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAMESPACE, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
