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
