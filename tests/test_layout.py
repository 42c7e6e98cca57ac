"""The test suite's layout: tests/ mirrors xlm/ (xlm/a/b.py is tested in tests/a/test_b.py,
the logic of xlm/a/pkg/__init__.py in tests/a/test_pkg.py), test module names do not
collide, and every test folder is a package (so pytest imports each test module by its
full dotted name, and two folders' helper modules cannot shadow each other)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "xlm"
TESTS = ROOT / "tests"

# Modules with logic but no test module of their own, each with the reason.
ALLOWLIST = {
    "xlm/entrypoints/openai/routes/embeddings.py": "one route (e2e/test_server_embeddings.py)",
    "xlm/entrypoints/openai/routes/sleep.py": "admin routes (e2e/test_server_sleep.py)",
    "xlm/platforms/cuda.py": "constants and the data-parallel GPU env, tested in "
    "tests/ops/test_custom_op.py and tests/platforms/test_cpu.py",
    "xlm/platforms/rocm.py": "a device class of constants, tested in tests/ops/test_custom_op.py",
}

# Modules with logic still waiting for a test at the mirrored path (each is tested
# elsewhere or not at all): a debt to pay down. An entry whose test appears fails the
# check below, so the list only shrinks.
NOT_YET_MIRRORED: set[str] = set()


def has_logic(path: Path) -> bool:
    """A module defines a function or a class (re-exports and constants alone do not count)."""
    tree = ast.parse(path.read_text())
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return any(isinstance(node, defs) for node in tree.body)


def mirrored_test(module: Path) -> Path:
    """tests/a/test_b.py for xlm/a/b.py; tests/a/test_pkg.py for xlm/a/pkg/__init__.py."""
    rel = module.relative_to(PACKAGE)
    if rel.name == "__init__.py":
        return TESTS / rel.parent.parent / f"test_{rel.parent.name}.py"
    return TESTS / rel.parent / f"test_{rel.stem}.py"


def modules_with_logic() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py" or not has_logic(path):
            continue
        found.append(path.relative_to(ROOT).as_posix())
    return found


def test_every_module_with_logic_has_its_mirrored_test_module():
    exempt = ALLOWLIST.keys() | NOT_YET_MIRRORED
    missing = [
        f"{module} -> {mirrored_test(ROOT / module).relative_to(ROOT).as_posix()}"
        for module in modules_with_logic()
        if module not in exempt and not mirrored_test(ROOT / module).exists()
    ]
    assert not missing, "modules without a test at the mirrored path:\n" + "\n".join(missing)


def test_the_exemptions_are_current():
    modules = set(modules_with_logic())
    gone = sorted((ALLOWLIST.keys() | NOT_YET_MIRRORED) - modules)
    assert not gone, "exempted modules that are gone or have no logic:\n" + "\n".join(gone)
    tested = sorted(m for m in NOT_YET_MIRRORED if mirrored_test(ROOT / m).exists())
    assert not tested, "now mirrored: remove from NOT_YET_MIRRORED:\n" + "\n".join(tested)


def test_module_names_collide_only_between_mirrors():
    """Two test modules may share a name only when each mirrors its own xlm module
    (tests/test_config.py and tests/ray/test_config.py)."""
    mirrors = {mirrored_test(ROOT / m) for m in modules_with_logic()}
    by_name = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(path)
    clashes = [
        f"{name}: " + ", ".join(sorted(p.relative_to(ROOT).as_posix() for p in paths))
        for name, paths in sorted(by_name.items())
        if len(paths) > 1 and not all(p in mirrors for p in paths)
    ]
    assert not clashes, "test modules sharing a name:\n" + "\n".join(clashes)


def test_every_test_folder_is_a_package():
    folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    needed = {d for f in folders for d in (f, *f.parents) if d.is_relative_to(TESTS)}
    missing = sorted(
        d.relative_to(ROOT).as_posix() for d in needed if not (d / "__init__.py").exists()
    )
    assert not missing, "test folders without __init__.py:\n" + "\n".join(missing)
