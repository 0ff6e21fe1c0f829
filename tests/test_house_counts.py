"""tools/house_counts.py: the issue-33 counts of the package may not grow back, and the
script finds each kind of violation it counts (a planted package shows it)."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The counts reached so far: lower them as the rules are met, never raise them.
CEILINGS = {
    "recipe_classes_outside": 0,
    "quantizer_classes_outside": 0,
    "private_torch_reads": 0,
    "private_torch_reads_in_adapter": 5,
    # One, on purpose: fc.convert(model, autocast=True) sets the converted model's own
    # forward (an instance attribute, opted into by the user, undone by no one else), so
    # trainers that call model(...) run it under fc.autocast (nn/autocast_forward.py).
    "replacements": 1,
    "files_over_400_lines": 0,
    "import_cycles": 0,
    "package_import_cycles": 0,
    "longest_module_docstring": 51,
}


def _tool():
    spec = importlib.util.spec_from_file_location("house_counts", ROOT / "tools/house_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_stays_within_the_counts_reached():
    found = _tool().counts(ROOT)
    over = {
        key: (found[key], ceiling, found["where"].get(key))
        for key, ceiling in CEILINGS.items()
        if found[key] > ceiling
    }
    assert not over, over


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / "fastcast" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_each_kind_of_violation_is_counted(tmp_path):
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "recipe.py": """
                class Recipe: ...
                class SomeScaling(Recipe): ...
            """,
            "quantizers/__init__.py": "class Quantizer: ...\nclass SomeQuantizer: ...\n",
            "schemes/__init__.py": "from ..recipe import SomeScaling\nX = SomeScaling\n",
            "nn/__init__.py": """
                import sys
                from ..recipe import SomeScaling
                from ..quantizers import Quantizer, SomeQuantizer
                from .. import distributed
                from ..runtime import state


                def f(x, fn):
                    state.flag = True  # the state manager's own state: not counted
                    distributed.helper = fn  # counted: another module's function
                    owner = sys.modules.get("fastcast.distributed")
                    setattr(owner, "helper", fn)  # counted
                    quantizer: Quantizer = x  # the protocol: not counted
                    return isinstance(x, SomeScaling) or isinstance(quantizer, SomeQuantizer)


                def g():
                    return sys._getframe(1)
            """,
            "runtime/__init__.py": "",
            "runtime/state.py": "flag = False\n",
            "distributed/__init__.py": '"""One.\n\nTwo.\n"""\n\n\ndef helper():\n'
            "    from ..nn import f  # in-function imports count too\n\n    return f\n"
            + "\n"
            * 400,
        },
    )
    found = _tool().counts(tmp_path)
    assert found["recipe_classes_outside"] == 1  # schemes/ may name it; nn/ may not
    assert found["quantizer_classes_outside"] == 1
    assert found["private_torch_reads"] == 1
    assert found["replacements"] == 2, found["where"]["replacements"]
    assert found["files_over_400_lines"] == 1
    assert found["import_cycles"] == 1
    assert found["package_import_cycles"] == 1
    assert found["longest_module_docstring"] == 4  # lines in the file, quotes included
