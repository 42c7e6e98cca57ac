"""Sliding-window KV: a windowed model's request holds only the blocks its window can see.

The tiny Mistral attends to the last 8 tokens on every layer; with 16-token blocks a
decoding request must hold at most ceil(8 / 16) + 1 = 2 blocks however long it grows,
while its greedy output still equals transformers' and the prefix cache still hits.

Gemma 2 (alternating windowed and global layers) and Gemma 3 (five windowed to one
global) keep one KV cache group per window: every step, each windowed group holds at most
ceil((8 - 1 + n) / 16) + 1 blocks for a step of n tokens (2 while decoding) while the
global group holds every block of the request.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import xlm
from tests.conftest import VOCAB_SIZE, write_tiny_checkpoint
from tests.engine.reference import TINY_ENGINE, hf_greedy, load_hf, scheduler
from xlm.core.kv_cache_groups import window_block_bound
from xlm.core.kv_cache_manager import KVCacheManager
from xlm.worker.worker import kv_cache_bytes_per_block, kv_cache_groups, shared_sliding_window

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
    # Gemma 2 alternates windowed and global layers: no single window (groups instead).
    assert window("gemma2") is None
    assert window("llama") is None


def test_layer_groups_by_window(tiny_checkpoint):
    from xlm.config import ModelConfig, XlmConfig
    from xlm.models.loader import get_model

    def groups(arch: str):
        model = get_model(XlmConfig(ModelConfig(model=tiny_checkpoint(arch), load_format="dummy")))
        return [(g.sliding_window, g.layer_ids) for g in kv_cache_groups(model)]

    assert groups("gemma2") == [(None, (1,)), (WINDOW, (0,))]
    assert groups("mistral") == [(WINDOW, (0, 1))]
    assert groups("llama") == [(None, (0, 1))]

    # Gemma 2's two groups share one cache array: a block costs one layer's pages, and the
    # cache is sized from that (half of one table's cost for every layer).
    model = get_model(XlmConfig(ModelConfig(model=tiny_checkpoint("gemma2"), load_format="dummy")))
    one_table = kv_cache_bytes_per_block(model, BLOCK, jnp.float32)
    model.use_kv_cache_groups(kv_cache_groups(model))
    assert kv_cache_bytes_per_block(model, BLOCK, jnp.float32) * 2 == one_table
    assert len(model.make_kv_caches(4, BLOCK, jnp.float32)) == 1


def run_checking_groups(llm, prompt: list[int], request_id: str) -> tuple[list[int], int]:
    """Generate step by step asserting every step's per-group bounds; (output, steps)."""
    engine = llm.llm_engine
    kv = scheduler(llm).kv_cache_manager
    assert isinstance(kv, KVCacheManager) and len(kv.groups) > 1
    engine.add_request(request_id, prompt, greedy(NEW_TOKENS))
    steps, out, computed = 0, None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o.outputs[0].token_ids
        steps += 1
        running = {r.request_id: r for r in scheduler(llm).running}
        if request_id not in running:
            continue
        request = running[request_id]
        step_tokens = request.num_computed_tokens - computed
        computed = request.num_computed_tokens
        held = kv.num_held_blocks_per_group(request_id)
        for spec, n in zip(kv.specs, held, strict=True):
            if spec.sliding_window is None:
                assert n == -(-computed // BLOCK), f"step {steps}: full group holds {n}"
            else:
                bound = window_block_bound(spec.sliding_window, BLOCK, step_tokens)
                assert n <= bound, f"step {steps}: window group holds {n} > {bound}"
                if step_tokens == 1:  # decoding: ceil(window / block_size) + 1
                    assert n <= -(-spec.sliding_window // BLOCK) + 1
    return out, steps


def gemma_engine(path: str, num_blocks: int):
    return xlm.LLM(model=path, **dict(TINY_ENGINE, num_gpu_blocks_override=num_blocks))


@pytest.mark.parametrize(
    "arch, layer_types, num_blocks",
    [
        ("gemma2", None, 24),
        # Gemma 3's 5:1: six groups of one layer (five windowed), one shared cache array.
        ("gemma3", ["sliding_attention"] * 5 + ["full_attention"], 64),
        # 3 windowed, 2 global: groups of 2 layers over 2 shared arrays, and a remainder
        # windowed group of one layer.
        ("gemma3", ["sliding_attention"] * 3 + ["full_attention"] * 2, 48),
    ],
    ids=["gemma2", "gemma3-5to1", "gemma3-remainder"],
)
def test_gemma_window_groups_hold_window_blocks(arch, layer_types, num_blocks, tmp_path):
    changes = {}
    if layer_types is not None:
        changes = dict(num_hidden_layers=len(layer_types), layer_types=layer_types)
    path = write_tiny_checkpoint(arch, str(tmp_path / arch), **changes)
    llm = gemma_engine(path, num_blocks)
    kv = scheduler(llm).kv_cache_manager
    windows = [s.sliding_window for s in kv.specs]
    assert windows.count(None) == 1 and windows.count(WINDOW) == len(windows) - 1
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    # Layer j of every group shares array j.
    assert len(runner.kv_caches) == max(len(s.layer_ids) for s in kv.specs)
    prompt = np.random.default_rng(7).integers(6, VOCAB_SIZE, size=90).tolist()
    compiles = runner.num_compilations
    out, steps = run_checking_groups(llm, prompt, "long")
    assert steps > NEW_TOKENS  # chunked prefill of 90 tokens in steps of <= 64
    # 130 tokens need 9 blocks in the full group; a windowed group never more than 6.
    assert -(-(len(prompt) + NEW_TOKENS) // BLOCK) > window_block_bound(WINDOW, BLOCK, 64)
    assert out == hf_greedy(load_hf(path), prompt, NEW_TOKENS).token_ids
    assert kv.block_pool.get_usage() == 0.0  # everything returned

    hits = kv.prefix_cache_hits
    again, _ = run_checking_groups(llm, prompt, "again")
    assert kv.prefix_cache_hits - hits >= 64  # all groups served a 4+ block prefix
    assert again == out
    assert runner.num_compilations == compiles  # no compile after warm-up
