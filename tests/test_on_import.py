"""``import fastcast`` before ``torch._dynamo``: the polyfills register when Dynamo is
imported, and Dynamo's module is loaded as Python would load it (source, files)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_dynamo_imported_after_fastcast_registers_the_polyfills():
    script = textwrap.dedent(
        """
        import inspect, sys
        import fastcast
        assert "torch._dynamo" not in sys.modules, "import fastcast imported Dynamo"
        assert "fastcast.compile" not in sys.modules
        hooks = [f for f in sys.meta_path if type(f).__name__ == "_DynamoImportHook"]
        assert len(hooks) == 1
        import torch._dynamo
        assert "fastcast.compile" in sys.modules  # registered right after
        assert not any(type(f).__name__ == "_DynamoImportHook" for f in sys.meta_path)
        dynamo = sys.modules["torch._dynamo"]
        assert dynamo.__spec__.origin.endswith("__init__.py")
        assert dynamo.__spec__.submodule_search_locations
        assert "def " in inspect.getsource(dynamo)  # the loader still answers for its files
        import torch._dynamo.eval_frame  # submodules import as usual
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
