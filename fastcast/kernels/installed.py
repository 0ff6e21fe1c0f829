"""The CPU library built when fastcast was installed (``setup.py``), in ``installed/``.

``load`` imports it, with no compile and no lock, when its key (``build.abi_key``:
sources, flags, Python ABI, torch version, commit and C++ ABI) is this process's. Where
it was built for another torch (or the sources changed since: an editable checkout), it
says so once on stderr and ``build.load`` builds for this torch on first use, as
without it. ``FASTCAST_KERNELS_INSTALLED=0`` ignores it (the first-use build's own
tests; a library to rule out).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

# Nothing of the build modules is imported here (build.py calls this module): what a build
# knows, file names included, comes as arguments.

DIRECTORY = Path(__file__).with_name("installed")


def enabled() -> bool:
    """Whether ``FASTCAST_KERNELS_INSTALLED`` lets the installed library be used."""
    return os.environ.get("FASTCAST_KERNELS_INSTALLED", "1").strip() != "0"


def record(library: str, key_name: str) -> dict | None:
    """What the install wrote beside the library (its key, the build's seconds, where it
    was built), or None where no library was installed."""
    key_file = DIRECTORY / key_name
    if not (key_file.exists() and (DIRECTORY / library).exists()):
        return None
    try:
        data = json.loads(key_file.read_text())
    except (OSError, ValueError) as exc:
        return {"key": {}, "error": f"{type(exc).__name__}: {exc}"}
    if not (isinstance(data, dict) and isinstance(data.get("key"), dict)):
        return {"key": {}, "error": "no key in it"}
    return data


def mismatch(recorded: dict, wanted: dict[str, str]) -> str | None:
    """Why a library of key ``recorded`` cannot be loaded by a process of key ``wanted``
    (None: it can)."""
    if recorded.get("torch") != wanted["torch"]:
        return f"were built for torch {recorded.get('torch')} and this is torch {wanted['torch']}"
    if recorded.get("sources") != wanted["sources"]:
        return "were built from other sources (csrc/ changed since the install)"
    differ = sorted(k for k in wanted if recorded.get(k) != wanted[k])
    if differ:
        return f"were built for another {', '.join(differ)}"
    return None


def load(
    library: str,
    key_name: str,
    wanted: dict[str, str],
    say: Callable[[str], None],
    import_library: Callable[[Path], ModuleType],
) -> ModuleType | None:
    """The installed library, imported, or None (none installed, disabled, or built for
    another key than this process's ``wanted``: ``say``-ed)."""
    data = record(library, key_name) if enabled() else None
    if data is None:
        return None
    if "error" in data:
        reason = f"have a key file that does not read ({data['error']})"
    else:
        reason = mismatch(data["key"], wanted)
    if reason is not None:
        say(
            f"the fused kernels installed in {DIRECTORY} {reason}: not used; the kernel "
            "cache's build for this process is (built first where it is missing)"
        )
        return None
    try:
        return import_library(DIRECTORY / library)
    except ImportError as exc:  # a damaged file: the first-use build still works
        say(f"the fused kernels installed in {DIRECTORY} do not load ({exc})")
        return None
