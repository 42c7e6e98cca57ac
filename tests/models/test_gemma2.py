"""Gemma 2 and Gemma 3 (soft caps, sliding and full layers):
logits over a paged, chunked batch equal transformers'."""

from __future__ import annotations

import pytest

from tests.models.logits_check import check_logits_match_transformers


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_logits_match_transformers(arch, tiny_checkpoint):
    check_logits_match_transformers(arch, tiny_checkpoint)
