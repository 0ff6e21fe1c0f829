"""pytest hooks for the benchmark suites.

Collects each benchmark module's ``TARGETS`` (see ``bench/run.py``), checks their
shape, and stores them in the pytest-benchmark JSON under ``"fastcast"`` together with
the library versions, so that a saved JSON can be rendered again on its own.
"""

from __future__ import annotations

import numbers
import sys

import pytest
import torch

_TARGETS = pytest.StashKey[list]()


def _check_target(module: str, target: object) -> dict:
    ok = (
        isinstance(target, tuple)
        and len(target) in (5, 6)
        and all(isinstance(x, str) for x in (*target[:2], *target[4:]))
        and (isinstance(target[2], str) or (target[2] is None and len(target) == 6))
        and isinstance(target[3], numbers.Real)
        and target[3] > 0
    )
    if not ok:
        raise pytest.UsageError(
            f"{module}.TARGETS entries must be (group, subject_test, reference_test, "
            "max_ratio > 0, label[, extra_info metric]) tuples (reference_test None with "
            f"a metric: the metric's value itself is limited), got {target!r}"
        )
    group, subject, reference, max_ratio, label = target[:5]
    return {
        "metric": target[5] if len(target) == 6 else "median",
        "module": module,
        "group": group,
        "subject": subject,
        "reference": reference,
        "max_ratio": float(max_ratio),
        "label": label,
    }


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselect: a module's targets are all kept
def pytest_collection_modifyitems(session, config, items):
    targets = config.stash.setdefault(_TARGETS, [])
    seen = {t["module"] for t in targets}
    for item in items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        for target in getattr(module, "TARGETS", ()):
            targets.append(_check_target(module.__name__, target))


# optionalhook: bench/tests runs under `make test` too, where pytest-benchmark (the
# [bench] extra) may be missing and this hook would otherwise be an unknown one.
@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config, benchmarks, output_json):
    versions = {"python": sys.version.split()[0]}
    for name in ("torch", "fastcast", "torchao"):
        mod = sys.modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    output_json["fastcast"] = {
        "targets": config.stash.get(_TARGETS, []),
        "versions": versions,
    }


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny-tensor tests or benchmarks, restored after.

    The shapes are too small for torch's thread pool to help, and on a machine whose
    cores are shared its spinning workers can stall a tiny operation for milliseconds.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
