"""xlm's import graph: no cycles, and every import goes down the documented layer order.

The graph is read from the source with `ast`: imports at module level and inside
functions count (an upward import inside a function is still an upward import), relative
imports are resolved, and `if TYPE_CHECKING:` blocks are skipped (they never run). The
layer order is the one docs/architecture.md draws; there is no exceptions list.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "xlm"

# Top to bottom. A module may import modules of its own layer and of the layers below it.
# An entry names a package or a module; the longest entry that prefixes a module wins.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("xlm.entrypoints", "xlm.ray"),
    ("xlm.engine", "xlm.multimodal"),
    ("xlm.executor", "xlm.planning"),
    ("xlm.worker", "xlm.tokenizer"),
    (
        "xlm.models",
        "xlm.ops",
        "xlm.distributed",
        "xlm.structured_output",
        "xlm.reasoning",
        "xlm.lora",
    ),
    ("xlm.core",),
    ("xlm.metrics", "xlm.platforms", "xlm.plugins"),
    (
        "xlm",
        "xlm.config",
        "xlm.envs",
        "xlm.jax_version",
        "xlm.logger",
        "xlm.sampling_params",
        "xlm.pooling_params",
        "xlm.structured_output.params",
        "xlm.lora.request",
        "xlm.multimodal.inputs",
        "xlm.multimodal.budget",
        "xlm.multimodal.processor_config",
        "xlm.outputs",
        "xlm.disk_cache",
        "xlm.quantization",
    ),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest entry that is `module` or one of its parents."""
    best, best_len = None, -1
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            parent = entry != "xlm" and module.startswith(entry + ".")  # the root is a facade
            if (module == entry or parent) and len(entry) > best_len:
                best, best_len = index, len(entry)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and the doc"
    return best


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


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_imports_go_down_the_layers():
    graph = import_graph()
    upward = sorted(
        f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) < layer_of(module)
    )
    assert not upward, "imports that go up the layer order:\n" + "\n".join(upward)


def test_the_doc_draws_the_same_layers():
    """docs/architecture.md's layer block names the packages of LAYERS in the same order."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    drawn = [re.findall(r"[a-z_]+", line.split("  ")[0]) for line in block.strip().splitlines()]
    expected = [
        [e.removeprefix("xlm.") for e in entries if e.count(".") == 1] for entries in LAYERS
    ]
    assert [row for row in drawn if row] == [row for row in expected if row]


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
