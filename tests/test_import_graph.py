"""xlm's import graph: no cycles, and no lower layer importing the engine or entry points.

The graph is read from the source with `ast`: imports at module level and inside
functions count (a cycle through a function-level import is still a cycle), relative
imports are resolved, and `if TYPE_CHECKING:` blocks are skipped (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "xlm"

# Layers below the engine: none of them may import xlm.engine or xlm.entrypoints.
LOWER_LAYERS = (
    "xlm.worker",
    "xlm.models",
    "xlm.ops",
    "xlm.core",
    "xlm.platforms",
    "xlm.executor",
)
UPPER_LAYERS = ("xlm.engine", "xlm.entrypoints")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement in `tree` may load (outside TYPE_CHECKING)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            # `from pkg import name` may load the submodule pkg.name.
            names.update(f"{source}.{alias.name}" for alias in node.names)
        if isinstance(node, ast.If) and _is_type_checking(node):
            for stmt in node.orelse:
                visit_one(stmt)
        else:
            visit(node)

    visit(tree)
    return names


def import_graph() -> dict[str, set[str]]:
    """xlm module -> the xlm modules it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        targets = set()
        for imported in _imported_names(ast.parse(path.read_text()), name, is_package):
            while imported and imported not in modules:  # pkg.Class -> pkg
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_the_graph_sees_function_level_and_relative_imports():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "from .c import D\n"
        "if TYPE_CHECKING:\n"
        "    import xlm.hidden\n"
        "def f():\n"
        "    import xlm.inner\n"
    )
    names = _imported_names(tree, "xlm.pkg.a", is_package=False)
    assert {"xlm.pkg.b", "xlm.pkg.c", "xlm.pkg.c.D", "xlm.inner"} <= names
    assert "xlm.hidden" not in names
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_graph_covers_the_package():
    graph = import_graph()
    assert "xlm.engine.core" in graph and "xlm.core.scheduler" in graph["xlm.engine.core"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles among xlm's modules:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


@pytest.mark.parametrize("layer", LOWER_LAYERS)
def test_lower_layers_do_not_import_the_engine_or_entrypoints(layer):
    graph = import_graph()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module == layer or module.startswith(layer + ".")
        for target in targets
        if target.startswith(UPPER_LAYERS)
    )
    assert not upward, f"{layer} imports a higher layer:\n" + "\n".join(upward)


def test_tests_do_not_importorskip_xlm_modules():
    """A broken xlm import must fail its tests, not skip them."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).split(".")[0] == "xlm"
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.args[0].value}")
    assert not offenders, "importorskip of xlm's own modules:\n" + "\n".join(offenders)
