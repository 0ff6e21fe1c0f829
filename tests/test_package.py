"""The package's shape: no import cycles among its modules (lazy imports included), and it
ships its type marker."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fastcast

PACKAGE = Path(fastcast.__file__).parent


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = ["fastcast", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str) -> set[str]:
    """fastcast modules that ``module`` imports, at its top level or inside its functions
    (a lazy import is a dependency all the same: it only hides a cycle until the call),
    including ``importlib.import_module("fastcast...")`` with a literal name. Imports under
    ``if TYPE_CHECKING:`` never run and are left out."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node)
        for child in node.body
        for inner in ast.walk(child)
    }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fastcast"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("fastcast"):
                continue
            found.add(target)
            for alias in node.names:  # `from . import x` imports the submodule x
                found.add(f"{target}.{alias.name}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("fastcast")
        ):
            found.add(node.args[0].value)
    return found


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the fastcast modules its import runs first."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in _imports(path, name):
            # A package the importer is inside is already being imported: no new edge.
            if target not in modules or _inside(name, target):
                continue
            edges.add(target)
            # Importing a.b.c runs the __init__ of every package on the way.
            parts = target.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if not _inside(name, parent):
                    edges.add(parent)
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    graph = _graph()
    assert "fastcast.schemes.delayed" in graph and "fastcast.nn.function" in graph
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_import_of_the_package_names_a_module_it_has():
    """An import of a fastcast module that does not exist (a relative import left behind
    when its module moved) fails only when its function first runs; the graph above would
    skip it. Each name imported must be a module, or a name in one."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    missing = sorted(
        f"{name} imports {target}"
        for name, path in modules.items()
        for target in _imports(path, name)
        if target not in modules and target.rpartition(".")[0] not in modules
    )
    assert not missing, missing


def test_cycle_detector_sees_a_cycle(tmp_path):
    """The check above fails on a real cycle, also one through a package __init__."""
    pkg = tmp_path / "fastcast"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import y\nx = 1\n")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import x\ny = 2\n")
    graph = _graph(pkg)
    assert graph["fastcast.a"] == {"fastcast.sub", "fastcast.sub.b"}
    assert _find_cycle(graph) is not None
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    assert _find_cycle(_graph(pkg)) is None


def test_function_never_imports_the_module_class():
    """The autograd Function receives what it needs; it does not reach back into Linear,
    not even for type hints."""
    tree = ast.parse((PACKAGE / "nn" / "function.py").read_text())
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    assert imported and not {"linear", "nn.linear", "fastcast.nn.linear"} & imported


def test_ships_py_typed():
    assert (PACKAGE / "py.typed").is_file()


def test_import_fastcast_leaves_dcp_unimported():
    """``fastcast.dcp`` imports torch.distributed.checkpoint; ``import fastcast`` must not
    pay for it (a fresh interpreter: this one has imported everything already)."""
    code = (
        "import sys, fastcast; "
        "print('fastcast.dcp' in sys.modules, 'torch.distributed.checkpoint' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_import_fastcast_leaves_dynamo_unimported_until_torch_compile_needs_it():
    """``import fastcast`` does not pay the second ``torch._dynamo`` takes to import; the
    polyfills of ``fastcast.compile`` are registered when it is imported, before or after."""
    code = (
        "import sys, fastcast; m = sys.modules; "
        "print('torch._dynamo' in m, 'fastcast.compile' in m); "
        "import torch._dynamo; print('fastcast.compile' in m)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True"]
    code = "import sys, torch._dynamo, fastcast; print('fastcast.compile' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]


# The layers, bottom up (docs/architecture.md): a module imports only modules of its own
# layer or below, at its top level and inside its functions alike.
LAYERS = (
    "formats",
    "recipe",
    "reference",
    "kernels",
    "tensor",
    "token_groups",
    "runtime",
    "quantizers",
    "gemm_microscaled",
    "gemm",
    "serialization",
    "schemes",
    "gemm_grouped",
    "autocast",
    "distributed",
    "nn",
    "dcp",
    "numerics",
    "profiling",
    "compile",
    "integrations",
    "_on_import",
)


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    found = []
    for module, targets in graph.items():
        parts = module.split(".")
        if len(parts) == 1:  # the package's __init__: the public names, from every layer
            continue
        for target in targets:
            source_layer, target_layer = parts[1], target.split(".")[1]
            if source_layer == target_layer:
                continue
            if source_layer not in rank or target_layer not in rank:
                found.append(f"{module} -> {target}: a layer LAYERS does not place")
            elif rank[target_layer] > rank[source_layer]:
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_layers_import_one_way():
    """``nn`` over ``distributed``, ``schemes`` over ``quantizers``: no import, lazy ones
    included, reaches a layer above its own (what ``pass a reducer in`` or moving a
    primitive down fixes)."""
    upward = _upward_imports(_graph())
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_layer_check_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "fastcast"
    (pkg / "nn").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "nn" / "__init__.py").write_text("")
    (pkg / "quantizers.py").write_text("def f():\n    from .nn import x\n")
    upward = _upward_imports(_graph(pkg))
    assert upward == ["fastcast.quantizers -> fastcast.nn"]
