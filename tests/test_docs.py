"""The docs cite only files the repo has, and figures the code still has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

# A cited source or doc file: `xlm/worker/worker.py`, `packing.py`, docs/engine.md, ...
_FILE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:py|md))\b")


def _exists(doc: Path, cited: str) -> bool:
    if (doc.parent / cited).exists() or (ROOT / cited).exists():
        return True
    if "/" in cited:  # a path: relative to the repo root or to a package directory
        return any(ROOT.glob(f"*/{cited}")) or any(ROOT.glob(f"*/*/{cited}"))
    return any(ROOT.glob(f"**/{cited}"))  # a bare file name somewhere in the repo


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_files_exist(doc):
    text = doc.read_text()
    missing = sorted({m for m in _FILE.findall(text) if not _exists(doc, m)})
    assert not missing, f"{doc.name} cites files not in the repo: {missing}"


def test_attention_tile_size_matches_the_code():
    from xlm.ops.paged_attention import _TILE_TOKENS

    text = (ROOT / "docs" / "engine.md").read_text()
    cited = [int(n) for n in re.findall(r"tiles of (\d+) tokens", text)]
    assert cited and all(n == _TILE_TOKENS for n in cited), (cited, _TILE_TOKENS)


def _module_map_rows() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| `")]


def documented_modules() -> set[str]:
    """Files the module map names: a full path sets the folder for the bare names after it.

    A row whose first column is a folder (`xlm/ops/`) may name that folder's files in its
    second column; other rows name files in the first column only.
    """
    named = set()
    for row in _module_map_rows():
        folder = ""
        cells = row.split("|")
        text = cells[1] + (cells[2] if cells[1].strip().endswith("/`") else "")
        for cited in re.findall(r"`([\w/.]+)`", text):
            if cited.startswith(("xlm/", "pallas_kernels/")):
                folder = cited if cited.endswith("/") else cited.rpartition("/")[0] + "/"
                named.add(cited)
            elif cited.endswith(".py") and folder:
                named.add(folder + cited)
    return named


def test_module_map_matches_the_tree():
    """Every module and folder of xlm/ is in docs/architecture.md's map, and nothing else."""
    named = documented_modules()
    tree = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "xlm").rglob("*.py")
        if path.name != "__init__.py" or path.read_text().strip().count("\n") > 2
    }
    folders = {str(p.relative_to(ROOT)) + "/" for p in (ROOT / "xlm").rglob("*") if p.is_dir()}
    folders = {f for f in folders if "__pycache__" not in f}
    covered = {f for f in tree if f in named or f.replace("__init__.py", "") in named}
    assert tree - covered == set(), f"modules missing from the map: {sorted(tree - covered)}"
    assert folders - {f for f in folders if any(n.startswith(f) for n in named)} == set()
    stale = {n for n in named if not (ROOT / n).exists()}
    assert not stale, f"the map names files that do not exist: {sorted(stale)}"


def _cli_flags() -> dict[str, set[str]]:
    """Each `xlm` subcommand's option strings, from the real parser."""
    from xlm.entrypoints.cli import SUBCOMMANDS, build_parser

    flags = {}
    for name in SUBCOMMANDS:
        parser = build_parser(name)
        sub = next(a for a in parser._actions if a.dest == "command").choices[name]
        flags[name] = {s for action in sub._actions for s in action.option_strings}
    return flags


def _xlm_commands(text: str) -> list[tuple[str, str]]:
    """(subcommand, rest of the line) of every `xlm SUBCOMMAND ...` a doc shows, with
    backslash continuations joined."""
    text = text.replace("\\\n", " ")
    return re.findall(r"(?:^|[\s`(])xlm ([a-z-]+)((?:[^\n`]*))", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_cli_flags_exist(doc):
    """Every `--flag` on an `xlm SUBCOMMAND` line of the docs is a flag of that subcommand."""
    flags = _cli_flags()
    unknown = set()
    for command, rest in _xlm_commands(doc.read_text()):
        if command not in flags:
            continue  # prose such as "xlm keeps", not a command
        rest = rest.split("#", 1)[0]
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            if flag not in flags[command]:
                unknown.add(f"xlm {command} {flag}")
    assert not unknown, f"{doc.name} shows flags the CLI does not have: {sorted(unknown)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_extras_exist(doc):
    """Every extra a doc installs (`.[x]`, `xlm[x]`) is one pyproject.toml declares."""
    import tomllib

    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    named = set()
    for group in re.findall(r"(?:\.|xlm)\[([\w,\s-]+)\]", doc.read_text()):
        named.update(e.strip() for e in group.split(","))
    assert named <= extras, f"{doc.name} installs extras pyproject.toml lacks: {named - extras}"


def test_readme_program_counts_match_the_bucket_policy():
    """README's start-up paragraph counts the built-in model's programs as the default
    bucket policy makes them: a model program per token bucket, the sampler buckets those
    steps run, and the prompt-logprobs program."""
    from xlm.engine.arg_utils import EngineArgs
    from xlm.worker.buckets import Buckets

    buckets = Buckets.from_config(EngineArgs(model="smollm2-135m").create_config())
    tokens = buckets.token_buckets
    samplers = {r for t in tokens for r in buckets.sampler_buckets_for_tokens(t)}
    total = len(tokens) + len(samplers) + 1
    first = {
        k
        for b in buckets.serving_buckets()
        for k in [("model", b)] + [("sampler", r) for r in buckets.sampler_buckets_for_tokens(b)]
    }
    text = " ".join((ROOT / "README.md").read_text().split())
    assert f"compiles all {total} first" in text
    assert f"compile {len(first)} programs first" in text
    assert f"and of the {buckets.serving_buckets()[0]}-token bucket" in text
    assert f"compile the other {total - len(first)}" in text
