"""The real SmolLM2-135M-Instruct GGUF: xlm's logits equal transformers' on the same weights."""

from __future__ import annotations

import numpy as np
import torch

from tests.models.logits_check import PROMPT_LENS, SCHEDULE, run_schedule
from xlm.config import ModelConfig, XlmConfig
from xlm.models.loader import get_model
from xlm.tokenizer import get_tokenizer

TEXTS = {
    "A": "The capital of France is Paris, and the capital of Germany is Berlin.",
    "B": "def fibonacci(n):\n    if n < 2:\n        return n",
    "C": "Once upon a time, in a land far away, there lived a small dragon who loved tea.",
}


def test_smollm2_gguf_logits_equal_transformers(smollm2_gguf, smollm2_transformers_model):
    tokenizer = get_tokenizer(smollm2_gguf)
    fed = {r: sum(plan.get(r, 0) for plan in SCHEDULE) for r in PROMPT_LENS}
    token_ids = {r: tokenizer.encode(TEXTS[r])[: fed[r]] for r in PROMPT_LENS}
    assert all(len(ids) == fed[r] for r, ids in token_ids.items())
    model = get_model(XlmConfig(ModelConfig(model=smollm2_gguf, dtype="float32")))
    # Prompts, a prompt in two chunks (the second mid-page) and decodes, over a paged cache.
    got = run_schedule(model, token_ids, seed=7)
    for r, ids in token_ids.items():
        with torch.no_grad():
            ref = smollm2_transformers_model(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(
            got[r], ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max(), err_msg=f"request {r}"
        )
        # And the same next-token choice everywhere.
        np.testing.assert_array_equal(got[r].argmax(-1), ref.argmax(-1))
