"""Register ``fastcast.compile`` with Dynamo when ``torch._dynamo`` is imported.

Invariant: nothing of Dynamo's (or importlib's) is modified. Importing ``torch._dynamo``
takes about a second, so ``import fastcast`` does not: if it is imported already the
polyfills register at once; otherwise a one-shot finder on ``sys.meta_path`` (Python's
documented import extension point) hands the import system a spec whose loader runs the
real loader, then registers them. Pinned by ``tests/test_on_import.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

_DYNAMO = "torch._dynamo"


def register_when_dynamo_imported() -> None:
    if _DYNAMO in sys.modules:
        importlib.import_module("fastcast.compile")
    else:
        sys.meta_path.insert(0, _DynamoImportHook())


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)  # one shot: the real finders locate the module
        found = importlib.util.find_spec(name)
        if found is None or found.loader is None:
            return found
        spec = importlib.machinery.ModuleSpec(
            name,
            _ThenRegister(found.loader),
            origin=found.origin,
            loader_state=found.loader_state,
            is_package=found.submodule_search_locations is not None,
        )
        spec.submodule_search_locations = found.submodule_search_locations
        spec.has_location = found.has_location
        return spec


class _ThenRegister(importlib.abc.Loader):
    """The real loader's module, then ``fastcast.compile``; everything else delegated."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        importlib.import_module("fastcast.compile")

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, resource readers
        return getattr(self.loader, name)
