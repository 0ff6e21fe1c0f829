"""The house rules of issue 33, counted from the files of ``fastcast/`` (``python
tools/house_counts.py [root]``; ``--json`` for the numbers only). Static, by ``ast``:
nothing of fastcast is imported.

- ``recipe_classes_outside`` / ``quantizer_classes_outside``: uses (a name or an
  attribute; import lines left out) of the recipe classes (``Recipe``'s subclasses in
  ``recipe.py``) and of the public classes of ``quantizers/`` (its protocol ``Quantizer``
  left out, as ``Recipe`` is: consumers may name the interface, not what implements it),
  outside ``recipe.py``, ``schemes/`` and ``quantizers/``;
- ``private_torch_reads``: uses of ``_getframe``, ``_top_saved_tensors_default_hooks``,
  ``__closure__`` and ``cell_contents`` (outside the one adapter, and inside it);
- ``replacements``: another module's functions or methods replaced: an assignment,
  ``setattr`` or ``delattr`` on a name bound by an import (a module or a class of another
  module, the state manager's left out) or on an object looked up through
  ``sys.modules``, and an assignment of a loader's or a layer's method (``exec_module``,
  ``forward``, ``__enter__``...) on an object that is not ``self``;
- ``import_cycles``: strongly connected groups of modules (module-level and in-function
  imports alike, ``if TYPE_CHECKING:`` left out), and of ``fastcast``'s top-level
  packages (``package_import_cycles``: ``nn`` and ``distributed`` importing each other);
- ``files_over_400_lines`` and ``longest_module_docstring`` (lines).
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

PRIVATE = ("_getframe", "_top_saved_tensors_default_hooks", "__closure__", "cell_contents")
ADAPTER = "nn/torch_checkpoint.py"  # the one module allowed to read torch internals
PROTOCOL = "Quantizer"  # the interface of quantizers/, which every consumer may name
METHOD_NAMES = {"exec_module", "find_spec", "forward", "backward", "__enter__", "__exit__"}


def _files(package: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(package.rglob("*.py")):
        yield path.relative_to(package).as_posix(), path


def _module_name(rel: str) -> str:
    parts = ["fastcast", *rel[: -len(".py")].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _defined_classes(package: Path, where: str, base: str | None = None) -> set[str]:
    """Public classes defined in ``where`` (a file or a folder); with ``base``, only its
    subclasses there (the base itself left out)."""
    names = set()
    for rel, path in _files(package):
        if rel == where or rel.startswith(where + "/"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    bases = {ast.unparse(b) for b in node.bases}
                    if base is None or base in bases:
                        names.add(node.name)
    return names


def _names_used(tree: ast.AST) -> Iterator[str]:
    """Names and attributes in the code (import lines left out: a use is what counts)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr


def _inside_schemes(rel: str) -> bool:
    return rel == "recipe.py" or rel.split("/")[0] in ("schemes", "quantizers")


STATE_MANAGER = ("runtime.state", "runtime.observers")


def _imported_names(tree: ast.AST) -> set[str]:
    """Names bound by imports, except the state manager's (writing its state is its use)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                source = f"{node.module or ''}.{a.name}"
                if not any(source.endswith(m) or m in source for m in STATE_MANAGER):
                    bound.add(a.asname or a.name)
    return bound


def _base_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _replacements(tree: ast.AST) -> list[int]:
    """Line numbers of replacements (see the module docstring)."""
    imported = _imported_names(tree)
    via_sys_modules = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and "sys.modules" in ast.unparse(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    foreign = imported | via_sys_modules
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            base = _base_name(target)
            if base in foreign or (target.attr in METHOD_NAMES and base != "self"):
                lines.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and _base_name(node.args[0]) in foreign
        ):
            lines.append(node.lineno)
    return lines


def _import_edges(package: Path) -> dict[str, set[str]]:
    modules = {_module_name(rel): path for rel, path in _files(package)}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        skipped = {  # imports under ``if TYPE_CHECKING:`` never run
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body
            for inner in ast.walk(child)
        }
        for node in ast.walk(tree):
            found: list[str] = []
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = name.split(".")
                    keep = len(parts) - node.level + (1 if is_package else 0)
                    base = ".".join(parts[:keep] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                found = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for target in found:
                while target and target not in modules:  # a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def _top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fastcast"


def counts(root: Path) -> dict[str, object]:
    """Every count, with where each one comes from."""
    package = root / "fastcast"
    recipes = _defined_classes(package, "recipe.py", base="Recipe")
    quantizers = _defined_classes(package, "quantizers") - {PROTOCOL}
    out: dict[str, object] = {}
    where: dict[str, list[str]] = {
        "recipe_classes_outside": [],
        "quantizer_classes_outside": [],
        "private_torch_reads": [],
        "private_torch_reads_in_adapter": [],
        "replacements": [],
        "files_over_400_lines": [],
    }
    longest = (0, "")
    for rel, path in _files(package):
        text = path.read_text()
        tree = ast.parse(text)
        if not _inside_schemes(rel):
            for used in _names_used(tree):
                if used in recipes:
                    where["recipe_classes_outside"].append(f"{rel}:{used}")
                if used in quantizers:
                    where["quantizer_classes_outside"].append(f"{rel}:{used}")
        key = "private_torch_reads_in_adapter" if rel == ADAPTER else "private_torch_reads"
        where[key] += [f"{rel}:{u}" for u in _names_used(tree) if u in PRIVATE]
        where["replacements"] += [f"{rel}:{line}" for line in _replacements(tree)]
        lines = text.count("\n")
        if lines > 400:
            where["files_over_400_lines"].append(f"{rel} ({lines})")
        if ast.get_docstring(tree) is not None:  # its lines in the file, quotes included
            first = tree.body[0]
            span = first.end_lineno - first.lineno + 1
            if span > longest[0]:
                longest = (span, rel)
    for key, found in where.items():
        out[key] = len(found)
    edges = _import_edges(package)
    module_cycles = _cycles(edges)
    package_edges: dict[str, set[str]] = {}
    for source, targets in edges.items():
        top = _top_package(source)
        package_edges.setdefault(top, set()).update(
            t for t in map(_top_package, targets) if t != top and t != "fastcast"
        )
    package_cycles = _cycles(package_edges)
    out["import_cycles"] = len(module_cycles)
    out["package_import_cycles"] = len(package_cycles)
    out["longest_module_docstring"] = longest[0]
    out["where"] = {
        **where,
        "import_cycles": [" -> ".join(g) for g in module_cycles],
        "package_import_cycles": [" <-> ".join(g) for g in package_cycles],
        "longest_module_docstring": [longest[1]],
    }
    return out


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    root = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    found = counts(root)
    if "--json" in argv:
        print(json.dumps({k: v for k, v in found.items() if k != "where"}, indent=1))
        return 0
    where = found["where"]
    for key, value in found.items():
        if key == "where":
            continue
        print(f"{key:32s} {value}")
        if "--where" in argv:
            for item in where.get(key, []):
                print(f"    {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
