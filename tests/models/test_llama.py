"""Llama (and Llama 3's rope scaling, tied embeddings, one KV head):
logits over a paged, chunked batch equal transformers'."""

from __future__ import annotations

import pytest

from tests.models.logits_check import check_logits_match_transformers


@pytest.mark.parametrize("arch", ["llama", "llama3"])
def test_logits_match_transformers(arch, tiny_checkpoint):
    check_logits_match_transformers(arch, tiny_checkpoint)
