"""Mistral (a sliding window on every layer):
logits over a paged, chunked batch equal transformers'."""

from __future__ import annotations

from tests.models.logits_check import check_logits_match_transformers


def test_logits_match_transformers(tiny_checkpoint):
    check_logits_match_transformers("mistral", tiny_checkpoint)
