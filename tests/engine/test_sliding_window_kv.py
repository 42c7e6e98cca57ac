"""Sliding-window KV: a windowed model's request holds only the blocks its window can see.

The tiny Mistral attends to the last 8 tokens on every layer; with 16-token blocks a
decoding request must hold at most ceil(8 / 16) + 1 = 2 blocks however long it grows,
while its greedy output still equals transformers' and the prefix cache still hits.
"""

from __future__ import annotations

import numpy as np
import pytest

import xlm
from tests.conftest import VOCAB_SIZE
from tests.engine.reference import TINY_ENGINE, hf_greedy, load_hf, scheduler
from xlm.worker.worker import shared_sliding_window

WINDOW = 8  # TINY_CONFIGS["mistral"]
BLOCK = TINY_ENGINE["block_size"]
NEW_TOKENS = 40


def greedy(n: int) -> xlm.SamplingParams:
    return xlm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_tracking_blocks(llm, prompt: list[int], request_id: str) -> tuple[list[int], int, int]:
    """Generate step by step; (output ids, most blocks held while decoding, steps)."""
    engine = llm.llm_engine
    kv = scheduler(llm).kv_cache_manager
    engine.add_request(request_id, prompt, greedy(NEW_TOKENS))
    most, steps, out = 0, 0, None
    while engine.has_unfinished_requests():
        # Requests that had computed the whole prompt before this step decode in it; what
        # they hold after it is what their decode step allocated.
        decoding = {
            r.request_id for r in scheduler(llm).running if r.num_computed_tokens >= len(prompt)
        }
        for o in engine.step():
            if o.finished:
                out = o.outputs[0].token_ids
        steps += 1
        for r in scheduler(llm).running:
            if r.request_id in decoding:
                most = max(most, kv.num_held_blocks(r.request_id))
    return out, most, steps


@pytest.fixture(scope="module")
def mistral(tiny_checkpoint):
    path = tiny_checkpoint("mistral")
    return path, xlm.LLM(model=path, **TINY_ENGINE)


def test_windowed_request_holds_window_blocks_and_matches_transformers(mistral):
    path, llm = mistral
    kv = scheduler(llm).kv_cache_manager
    assert kv.sliding_window == WINDOW
    prompt = np.random.default_rng(5).integers(6, VOCAB_SIZE, size=90).tolist()
    out, most, steps = run_tracking_blocks(llm, prompt, "long")
    assert steps > NEW_TOKENS  # the 90-token prompt was prefilled in chunks of <= 64
    bound = -(-WINDOW // BLOCK) + 1
    assert 0 < most <= bound, f"held {most} blocks, window allows {bound}"
    # 130 tokens would need 9 blocks without the window.
    assert -(-(len(prompt) + NEW_TOKENS) // BLOCK) > 2 * bound
    assert out == hf_greedy(load_hf(path), prompt, NEW_TOKENS).token_ids
    assert kv.block_pool.get_usage() == 0.0  # everything returned

    # The prefix cache still works: the blocks of the prompt are cached though freed early.
    hits = kv.prefix_cache_hits
    again, _, _ = run_tracking_blocks(llm, prompt, "again")
    assert kv.prefix_cache_hits > hits
    assert again == out


def test_mixed_or_absent_windows_keep_full_attention_kv(tiny_checkpoint):
    from xlm.config import ModelConfig, XlmConfig
    from xlm.models.loader import get_model

    def window(arch: str):
        model = get_model(XlmConfig(ModelConfig(model=tiny_checkpoint(arch), load_format="dummy")))
        return shared_sliding_window(model)

    assert window("mistral") == WINDOW
    # Gemma 2 alternates windowed and global layers: one block table must serve both.
    assert window("gemma2") is None
    assert window("llama") is None
