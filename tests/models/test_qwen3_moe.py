"""Qwen3-MoE (routed experts beside dense layers):
logits over a paged, chunked batch equal transformers'."""

from __future__ import annotations

from tests.models.logits_check import check_logits_match_transformers


def test_logits_match_transformers(tiny_checkpoint):
    check_logits_match_transformers("qwen3_moe", tiny_checkpoint)
