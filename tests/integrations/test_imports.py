"""fastcast depends on no trainer: ``import fastcast`` imports none, and the Lightning
plugin's module says what to install when Lightning is missing."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_import_fastcast_imports_no_trainer():
    code = (
        "import sys, fastcast; "
        "print(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'lightning', 'pytorch_lightning', 'accelerate', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]"]


def test_lightning_plugin_without_lightning_says_what_to_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "fastcast.integrations.lightning", raising=False)
    monkeypatch.setitem(sys.modules, "lightning", None)  # an import of it fails
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch.plugins.precision", None)
    with pytest.raises(ImportError, match=r"needs the lightning package \(pip install"):
        importlib.import_module("fastcast.integrations.lightning")
    assert "fastcast.integrations.lightning" not in sys.modules
