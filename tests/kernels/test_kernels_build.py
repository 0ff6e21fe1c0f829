"""The fused kernels' build on first use: what names its directory, the message a user
sees while it runs, one build when processes start together, and an installed wheel
that builds them (or falls back to the reference with one warning when it cannot).

The tests that compile for real or build a wheel take minutes on two cores: they are
marked ``slow`` and run only with ``FASTCAST_SLOW_TESTS=1`` (``make test-slow``, which
``.ci/run`` runs after ``make test``)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from fastcast.kernels import build, choice, sources
from fastcast.quantizers import tensorwise
from fastcast.quantizers.tensorwise import CurrentScalingQuantizer

ROOT = Path(__file__).resolve().parents[2]
RUN_SLOW = os.environ.get("FASTCAST_SLOW_TESTS") == "1"


def slow(test):
    marked = pytest.mark.slow(test)
    reason = "builds for minutes: set FASTCAST_SLOW_TESTS=1 (make test-slow)"
    return pytest.mark.skipif(not RUN_SLOW, reason=reason)(marked)


@pytest.fixture
def fresh_process_state(monkeypatch):
    """The process forgets its loaded library and kernel choice for one test."""
    monkeypatch.setattr(build, "_loaded_seconds", None)
    monkeypatch.delenv("FASTCAST_KERNELS", raising=False)
    monkeypatch.setenv("FASTCAST_KERNELS_INSTALLED", "0")  # the first-use path
    choice.refresh()
    yield
    choice.refresh()


def _spy_reference(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = tensorwise.scale_and_cast
    monkeypatch.setattr(tensorwise, "scale_and_cast", lambda *a: calls.append(1) or real(*a))
    return calls


# --------------------------------------------------------------------------- packaging


def test_the_wheel_ships_every_file_the_build_reads():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["fastcast"]
    package = ROOT / "fastcast"
    on_disk = {p.relative_to(package).as_posix() for p in build.CSRC.rglob("*") if p.is_file()}
    files = (*build.SOURCES, *build.HEADERS, *build.CUDA_SOURCES, *build.CUDA_HEADERS)
    read = {p.relative_to(package).as_posix() for p in files}
    assert on_disk == read, "csrc/ and build.SOURCES/HEADERS/CUDA_SOURCES/CUDA_HEADERS disagree"
    shipped = {f for f in read if any(fnmatch.fnmatch(f, p) for p in patterns)}
    assert shipped == read, f"not in the wheel: {sorted(read - shipped)}"


def test_an_incomplete_install_falls_back_with_one_warning(
    fresh_process_state, monkeypatch, tmp_path
):
    # A wheel without fp8.h: the key cannot be computed; that must not escape as a
    # FileNotFoundError from the first quantize.
    monkeypatch.setenv("FASTCAST_KERNELS_DIR", str(tmp_path))
    monkeypatch.setattr(sources, "HEADERS", (build.CSRC / "missing.h",))
    calls = _spy_reference(monkeypatch)
    x = torch.randn(8, 8)
    with pytest.warns(RuntimeWarning, match="could not be built.*missing.h") as record:
        got = CurrentScalingQuantizer().quantize(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        CurrentScalingQuantizer().quantize(x)
    assert len(record) == 1 and calls == [1, 1]
    assert (got.dequantize() - x).abs().max() <= x.abs().max() / 8  # a real quantize


# --------------------------------------------------------------------------- the key


def _compiler_wrapper(folder: Path) -> Path:
    """``g++`` in ``folder`` that runs the system's ``c++``, logging each call."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "g++"
    log = folder / "calls.log"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec c++ "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_the_build_directory_changes_with_the_compiler_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTCAST_KERNELS_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    key = build.build_key()
    base = build.build_dir(key)
    assert base.parent == tmp_path and build.build_dir() == base  # stable
    assert key["torch"] == torch.__version__ and key["compiler_version"]

    monkeypatch.setenv("CXX", str(_compiler_wrapper(tmp_path / "bin")))
    other = build.build_key()
    assert other["compiler"] == str(tmp_path / "bin" / "g++")
    assert other["compiler_version"] == key["compiler_version"]  # same g++ underneath
    assert build.build_dir(other) != base
    monkeypatch.delenv("CXX")

    monkeypatch.setattr(sources, "CFLAGS", (*build.CFLAGS, "-march=native"))
    assert build.build_dir() != base
    monkeypatch.undo()
    monkeypatch.setenv("FASTCAST_KERNELS_DIR", str(tmp_path / "elsewhere"))
    assert build.build_dir().name == base.name  # the root moves, the key does not


# --------------------------------------------------------------------------- messages

QUANTIZE = textwrap.dedent(
    """
    import warnings, torch
    from fastcast.kernels import choice
    from fastcast.quantizers.tensorwise import CurrentScalingQuantizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(64, 64)
        a = CurrentScalingQuantizer().quantize(x).dequantize()
        b = CurrentScalingQuantizer().quantize(x).dequantize()
    fused = choice.tensorwise_op(x) is not None
    print("fused" if fused else "reference", len(caught), torch.equal(a, b))
    for w in caught:
        print("warning:", w.category.__name__, str(w.message)[:100])
    """
)


def _quantize_in(python: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", QUANTIZE], env=env, cwd=cwd, capture_output=True, text=True, timeout=900
    )


def _env(**extra: str) -> dict[str, str]:
    """The first-use build's environment: this checkout on the path, and no library an
    (editable) install put in it."""
    env = {k: v for k, v in os.environ.items() if k not in ("FASTCAST_KERNELS", "CXX")}
    env["PYTHONPATH"] = str(ROOT)
    env["FASTCAST_KERNELS_INSTALLED"] = "0"
    return env | extra


def test_a_failing_build_says_so_on_stderr_and_warns_once(tmp_path):
    # No logging configured in the child; an empty kernel directory; a compiler that fails.
    env = _env(FASTCAST_KERNELS_DIR=str(tmp_path / "kernels"), CXX="false")
    done = _quantize_in(sys.executable, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "reference 1 True"
    assert "could not be built" in done.stdout
    assert done.stderr.count("fastcast: building the fused C++ quantize kernels") == 1
    assert "fastcast: building the fused kernels failed after" in done.stderr


@slow
def test_processes_starting_together_build_once_and_say_so(tmp_path):
    wrapper = _compiler_wrapper(tmp_path / "bin")
    env = _env(FASTCAST_KERNELS_DIR=str(tmp_path / "kernels"), CXX=str(wrapper))
    args = [sys.executable, "-c", QUANTIZE]
    first, second = (
        subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    )  # fmt: skip
    outs = [p.communicate(timeout=900) for p in (first, second)]
    for (out, err), p in zip(outs, (first, second)):
        assert p.returncode == 0, err
        assert out.splitlines()[0] == "fused 0 True", (out, err)
    errs = [err for _, err in outs]
    assert sum(e.count("fastcast: building the fused C++") for e in errs) == 1, errs
    assert sum(e.count("fastcast: built the fused kernels in") for e in errs) == 1, errs
    # Seven sources compiled and one link, by one process.
    calls = (tmp_path / "bin" / "calls.log").read_text().splitlines()
    compiles = [c for c in calls if " -c " in f" {c} "]
    links = [c for c in calls if "-shared" in c]
    assert len(compiles) == len(build.SOURCES) and len(links) == 1, calls
    # A later process loads the finished build in silence.
    later = _quantize_in(sys.executable, env, tmp_path)
    assert later.stdout.splitlines()[0] == "fused 0 True" and "fastcast:" not in later.stderr


# --------------------------------------------------------------------------- the wheel


def _pip(*args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout on the path
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        env=env | extra, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


# The first fastcast call a user makes: an fc.Linear's forward and backward under
# fc.autocast, timed from after the imports (which take as long with or without the
# kernels: seconds, many on a loaded machine).
FIRST_CALL = textwrap.dedent(
    """
    import time
    import torch
    import fastcast as fc
    from fastcast.kernels import build, choice
    start = time.perf_counter()
    layer = fc.Linear(64, 64)
    with fc.autocast(recipe=fc.Float8CurrentScaling()):
        out = layer(torch.randn(8, 64))
    out.sum().backward()
    seconds = time.perf_counter() - start
    print(choice.tensorwise_op(out) is not None, f"{seconds:.2f}", build.library_path())
    """
)


@slow
def test_a_wheel_in_a_fresh_environment_uses_the_fused_kernels(tmp_path):
    # The wheel, built without an isolated environment where this one has setuptools
    # recent enough (no download needed), else with one: against this torch either way.
    isolation = []
    try:
        import setuptools  # noqa: PLC0415

        if int(setuptools.__version__.split(".")[0]) >= 77:
            isolation = ["--no-build-isolation"]
    except ImportError:
        pass
    # From a copy of what the sdist holds: setuptools writes build/ and *.egg-info/
    # beside the sources, which must not land in the checkout.
    source = tmp_path / "src"
    shutil.copytree(ROOT / "fastcast", source / "fastcast",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "installed"))  # fmt: skip
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    # The install compiles the kernels (an empty kernel directory: nothing to reuse) and
    # says how long it took.
    built = _pip(
        "wheel", str(source), "--no-deps", *isolation, "-w", str(tmp_path / "dist"), "-v",
        FASTCAST_KERNELS_DIR=str(tmp_path / "install-cache"),
    )  # fmt: skip
    lines = (line.strip() for line in (built.stdout + built.stderr).splitlines())
    said = [line for line in lines if line.startswith("fastcast:")]
    print("\n".join(said))
    assert any(line.startswith("fastcast: built the fused kernels in") for line in said), said
    assert any("fused kernels installed in" in line for line in said), said
    (wheel,) = (tmp_path / "dist").glob("fastcast-*.whl")
    # A fresh environment that sees this one's packages (torch) but not its fastcast:
    # `venv --system-site-packages` would expose the base interpreter's, not this venv's.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    _pip("--python", python, "install", "--no-deps", "--no-index", str(wheel), "-q")
    # Then this environment's packages behind it (after the install, so that pip neither
    # sees nor touches them).
    torch_site = str(Path(torch.__file__).resolve().parents[1])
    Path(site, "parent_env.pth").write_text(torch_site + "\n")

    # A user's environment: no kernel cache, and a compiler that fails, so that any
    # build on first use would show (and fail).
    drop = ("PYTHONPATH", "FASTCAST_KERNELS_INSTALLED")
    env = {k: v for k, v in _env().items() if k not in drop}
    env |= {"FASTCAST_KERNELS_DIR": str(tmp_path / "empty"), "CXX": "false"}
    where = subprocess.run(
        [python, "-c", "import fastcast; print(fastcast.__file__)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert where.startswith(site), where  # the wheel's copy, not the checkout
    package = Path(where).parent
    installed = {p.name for p in (package / "kernels" / "csrc").iterdir()}
    assert installed >= {p.name for p in (*build.SOURCES, *build.HEADERS)}
    # The wheel compiled fc.autocast's C hot path (setup.py) and uses it.
    made = "import fastcast as fc; fc.autocast(False); print(type(fc.autocast(False)).__name__)"
    native = subprocess.run(
        [python, "-c", made],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert native == "NativeAutocast", native

    # The first fc call loads the library the install built: no build, no message,
    # within 5 s of starting the process.
    first = subprocess.run(
        [python, "-c", FIRST_CALL], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    fused, seconds, library = first.stdout.split()
    print(f"first fc call after installing the wheel: {seconds} s ({library})")
    installed_dir = package / "kernels" / "installed"
    assert fused == "True" and library == str(installed_dir / build.INSTALLED_LIBRARY)
    assert "fastcast:" not in first.stderr, first.stderr
    assert not (tmp_path / "empty").exists()  # nothing built, nothing cached
    assert float(seconds) < 5.0
    fused = _quantize_in(python, env, tmp_path)
    assert fused.stdout.splitlines()[0] == "fused 0 True", fused.stdout + fused.stderr

    # Another torch (the key says so): said, and the first-use build takes over; here it
    # fails (CXX=false), so the reference runs after exactly one warning.
    key_file = installed_dir / build.INSTALLED_KEY
    record = json.loads(key_file.read_text())
    record["key"]["torch"] = "0.0.0+other"
    key_file.write_text(json.dumps(record))
    fallback = _quantize_in(python, env, tmp_path)
    assert fallback.returncode == 0, fallback.stderr
    lines = fallback.stdout.splitlines()
    assert lines[0] == "reference 1 True" and "could not be built" in lines[1], lines
    assert "were built for torch 0.0.0+other" in fallback.stderr
