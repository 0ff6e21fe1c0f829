"""The library an install builds (``installed``, ``_jobs.install_into``) and the build's
child process (``_child``), without compiling: the library the test process already
loaded (``make kernels`` built it) stands in for an installed one.

What a user relies on: an installed library for this torch is used with no build and no
message; one built for another torch is said and not loaded, and the first-use build
takes over; nothing writes ``os.environ``. A real install (a wheel into a fresh
environment) is the slow test in ``test_kernels_build.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastcast.kernels import _child, build, choice, installed
from fastcast.kernels.__main__ import install_origin

ROOT = Path(__file__).resolve().parents[2]

# A fresh process whose installed/ folder is argv[1]; then a quantize, as QUANTIZE in
# test_kernels_build.py, and where the library came from.
QUANTIZE = textwrap.dedent(
    """
    import sys, warnings
    from pathlib import Path
    import torch
    from fastcast.kernels import build, choice, installed
    from fastcast.quantizers.tensorwise import CurrentScalingQuantizer
    installed.DIRECTORY = Path(sys.argv[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(64, 64)
        CurrentScalingQuantizer().quantize(x).dequantize()
    print("fused" if choice.tensorwise_op(x) is not None else "reference", len(caught))
    print(build.library_path())
    """
)


@pytest.fixture(scope="module")
def built_library() -> Path:
    """The CPU library this process loads (built by ``make kernels`` or found)."""
    try:
        build.load()
    except build.BuildError as exc:
        pytest.skip(f"the fused kernels do not build here: {exc}")
    return Path(build.library_path())


def _install(folder: Path, library: Path, key: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    shutil.copyfile(library, folder / build.INSTALLED_LIBRARY)
    record = {"key": key, "seconds": 12.5, "built_in": "elsewhere"}
    (folder / build.INSTALLED_KEY).write_text(json.dumps(record))
    return folder


def _run(folder: Path, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    # No kernel cache and a compiler that fails: any build would be seen (and fail).
    env = {k: v for k, v in os.environ.items() if k not in ("FASTCAST_KERNELS", "CXX")}
    env |= {"PYTHONPATH": str(ROOT), "FASTCAST_KERNELS_DIR": str(tmp_path / "cache")}
    env |= {"CXX": "false", **extra}
    return subprocess.run(
        [sys.executable, "-c", QUANTIZE, str(folder)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_an_installed_library_for_this_torch_loads_with_no_build(built_library, tmp_path):
    folder = _install(tmp_path / "installed", built_library, build.abi_key())
    done = _run(folder, tmp_path)
    assert done.returncode == 0, done.stderr
    result, where = done.stdout.splitlines()
    assert result == "fused 0"
    assert where == str(folder / build.INSTALLED_LIBRARY)
    assert "fastcast:" not in done.stderr  # no build, no message
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow  # a failing build attempt in a fresh interpreter
def test_a_library_for_another_torch_is_said_and_built_for(built_library, tmp_path):
    key = build.abi_key() | {"torch": "2.9.0+cu128"}
    folder = _install(tmp_path / "installed", built_library, key)
    done = _run(folder, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "reference 1"  # the build ran (and failed: CXX)
    said = f"were built for torch 2.9.0+cu128 and this is torch {torch.__version__}"
    assert said in done.stderr and "not used; the kernel cache's build" in done.stderr
    assert "fastcast: building the fused C++ quantize kernels" in done.stderr


@pytest.mark.slow  # three fresh interpreters, two failing build attempts
def test_edited_sources_and_the_switch_rule_out_the_library(built_library, tmp_path):
    key = build.abi_key() | {"sources": "0" * 64}
    stale = _install(tmp_path / "stale", built_library, key)
    done = _run(stale, tmp_path)
    assert done.stdout.splitlines()[0] == "reference 1", done.stderr
    assert "were built from other sources (csrc/ changed" in done.stderr

    broken = _install(tmp_path / "broken", built_library, build.abi_key())
    (broken / build.INSTALLED_KEY).write_text("{not json")
    done = _run(broken, tmp_path)
    assert done.stdout.splitlines()[0] == "reference 1", done.stderr
    assert "have a key file that does not read (JSONDecodeError" in done.stderr

    good = _install(tmp_path / "good", built_library, build.abi_key())
    done = _run(good, tmp_path, FASTCAST_KERNELS_INSTALLED="0")
    assert done.stdout.splitlines()[0] == "reference 1", done.stderr
    assert "installed" not in done.stderr  # ignored in silence


def test_the_key_names_what_a_library_must_match():
    key = build.abi_key()
    assert key["torch"] == torch.__version__
    assert key["torch_commit"] == torch.version.git_version
    assert installed.mismatch(key, key) is None
    assert "torch 1.0" in installed.mismatch(key | {"torch": "1.0"}, key)
    assert "cxx11_abi" in installed.mismatch(key | {"cxx11_abi": "x"}, key)
    assert "python" in installed.mismatch(key | {"python": "cpython-310"}, key)
    # The first-use key adds what changes the build, not what changes the library.
    assert build.build_key()["sources"] == key["sources"]


def test_the_install_job_copies_the_library_with_its_key(tmp_path):
    # The install's child, with this process's kernel cache: the library is found there
    # under the same key, so nothing compiles.
    cache = build.build_dir()
    if not (cache / build.BUILT_STAMP).exists():
        pytest.skip("no finished build in the kernel cache (make kernels builds one)")
    dest = tmp_path / "dest"
    env = _child.environment(os.environ)
    done = _child.run(["install", str(dest)], env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "already built for this torch" in done.stderr
    record = json.loads((dest / build.INSTALLED_KEY).read_text())
    assert record["key"] == build.abi_key()
    assert record["seconds"] >= 0 and record["built_in"] == str(cache)
    # make kernels says where it came from, not a copy's seconds as a build's time.
    assert record["from_cache"] is True
    assert install_origin(record) == f"copied at install from the kernel cache, {cache}"
    assert install_origin(record | {"from_cache": False}).startswith("built at install in")
    copied = (dest / build.INSTALLED_LIBRARY).read_bytes()
    assert copied == (cache / build.INSTALLED_LIBRARY).read_bytes()


class _Watched(dict):
    """``os.environ`` stand-in that records every write."""

    writes: list[str]

    def __setitem__(self, k, v):
        self.writes.append(k)
        super().__setitem__(k, v)

    def __delitem__(self, k):
        self.writes.append(k)
        super().__delitem__(k)

    def pop(self, k, *default):
        self.writes.append(k)
        return super().pop(k, *default)

    def update(self, *a, **kw):
        self.writes.append("update")
        super().update(*a, **kw)


def test_a_build_writes_no_environment_and_its_child_finds_ninja(monkeypatch, tmp_path):
    # PATH without ninja: the ninja wheel's directory reaches the child through the env
    # it is given, as it did through a PATH rewritten in this process before.
    watched = _Watched(os.environ)
    watched.writes = []
    monkeypatch.setattr(os, "environ", watched)
    monkeypatch.setitem(watched, "PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setitem(watched, "CXX", "/usr/bin/false")
    monkeypatch.setitem(watched, "FASTCAST_KERNELS_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(watched, "FASTCAST_KERNELS_INSTALLED", "0")
    monkeypatch.setattr(build, "_loaded_seconds", None)
    watched.writes.clear()
    if _child.ninja_dir(watched["PATH"]) is None:
        pytest.skip("no ninja wheel to find")
    with pytest.raises(build.BuildError) as caught:
        build.load()
    assert watched.writes == []
    assert "Ninja is required" not in str(caught.value)
    assert "false" in str(caught.value) or "compiler" in str(caught.value).lower()
    choice.refresh()


def test_the_child_environment_puts_ninja_first_and_leaves_its_base_alone(tmp_path):
    base = {"PATH": str(tmp_path), "PYTHONPATH": "x", "KEEP": "1"}
    env = _child.environment(base, drop=_child.ISOLATION_VARIABLES)
    assert base == {"PATH": str(tmp_path), "PYTHONPATH": "x", "KEEP": "1"}
    assert "PYTHONPATH" not in env and env["KEEP"] == "1"
    found = _child.ninja_dir(str(tmp_path))
    if found is not None:
        assert env["PATH"] == os.pathsep.join((found, str(tmp_path)))
        assert shutil.which("ninja", path=env["PATH"]) is not None
