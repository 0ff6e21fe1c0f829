"""Register ``fastcast.compile`` with Dynamo when ``torch._dynamo`` is imported.

Importing ``torch._dynamo`` takes about a second, so ``import fastcast`` does not: if it
is already imported the polyfills are registered at once; otherwise a one-shot import
hook registers them right after ``torch._dynamo`` finishes importing (``torch.compile``
imports it before tracing anything).
"""

from __future__ import annotations

import importlib
import importlib.abc
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
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            importlib.import_module("fastcast.compile")

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec
