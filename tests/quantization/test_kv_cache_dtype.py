"""--kv-cache-dtype fp8 / int8: K and V stored as float8 (e4m3fn or e5m2), or as int8 codes
with one float32 scale per (token, kv head) row, widened as attention reads them. The
reference is transformers with its attention reading K and V rounded the same way (torch's
own float8 conversion; int8 per row with scale = max|row| / 127); the cache's blocks grow
with the bytes per token; bad values are refused naming the choices."""

from __future__ import annotations

import numpy as np
import pytest

import xlm
from tests.conftest import VOCAB_SIZE
from tests.engine.reference import SMALL_ENGINE, TINY_ENGINE, hf_greedy, load_hf

NEW_TOKENS = 12


def fp8_attention_reference(path: str, torch_dtype):
    """transformers' sdpa attention with K and V rounded through `torch_dtype` (saturating
    float8) or, for torch.int8, per (token, head) row through int8 codes with the row's
    float32 scale max|row| / 127."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(x):
        if torch_dtype == torch.int8:
            scale = x.float().abs().amax(-1, keepdim=True) / 127.0
            codes = torch.where(scale > 0, x.float() / torch.where(scale > 0, scale, 1.0), 0.0)
            return (codes.round().clamp(-127, 127) * scale).to(x.dtype)
        limit = torch.finfo(torch_dtype).max
        return x.clamp(-limit, limit).to(torch_dtype).to(x.dtype)

    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, rounded(key), rounded(value), *args, **kwargs)

    name = f"xlm_test_{torch_dtype}".replace(".", "_")
    AttentionInterface.register(name, attention)
    model = load_hf(path)
    model.set_attn_implementation(name)
    return model


@pytest.mark.parametrize(
    ("kv_dtype", "torch_name"),
    [("fp8", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"), ("int8", "int8")],
)
def test_fp8_kv_cache_equals_reference(kv_dtype, torch_name, tiny_checkpoint):
    import torch

    base = tiny_checkpoint("llama")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(6, VOCAB_SIZE, size=n).tolist() for n in (5, 40)]
    llm = xlm.LLM(model=base, kv_cache_dtype=kv_dtype, **SMALL_ENGINE)
    params = xlm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    reference = fp8_attention_reference(base, getattr(torch, torch_name))
    plain = load_hf(base)
    moved = 0.0
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(reference, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref.token_ids
        shifted = ref.logits - ref.logits.max(-1, keepdims=True)
        want = (shifted - np.log(np.exp(shifted).sum(-1, keepdims=True)))[
            np.arange(NEW_TOKENS), ref.token_ids
        ]
        have = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(have, want, atol=2e-3)
        moved = max(moved, np.abs(ref.logits[0] - hf_greedy(plain, prompt, 1).logits[0]).max())
    assert moved > 1e-3  # the rounding changed the reference: an unrounded cache would fail
    import jax

    caches = jax.tree_util.tree_leaves(worker_of(llm).model_runner.kv_caches)
    assert {str(c.dtype) for c in caches} == {torch_name}
    if kv_dtype == "int8":
        # Rows carry their scale; a prompt extending a finished one reads its cached int8
        # blocks (prefix caching) and still matches.
        head_dim = worker_of(llm).model.kv_cache_spec()[2]
        assert {c.shape[-1] for c in caches} == {head_dim + 4}
        longer = prompts[1] + outs[1].outputs[0].token_ids + [7, 8]
        again = llm.generate([longer], params, use_tqdm=False)[0]
        assert again.num_cached_tokens >= 32
        assert again.outputs[0].token_ids == hf_greedy(reference, longer, NEW_TOKENS).token_ids
        # Sized in the same memory (the worker's own sizing, re-run without a fixed count),
        # int8 holds 4 * D / (D + 4) times float32's blocks: fewer than fp8's 4x.
        worker = worker_of(llm)
        cache = worker.config.cache_config
        cache.num_blocks, cache.kv_cache_memory = None, 0.01
        int8_blocks = worker._determine_num_blocks()
        worker.kv_dtype = np.dtype("float32")
        float_blocks = worker._determine_num_blocks()
        assert abs(int8_blocks - 4 * head_dim / (head_dim + 4) * float_blocks) <= 4
        assert int8_blocks < 4 * float_blocks - 4


def worker_of(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker


def test_kv_cache_dtype_sizes_blocks_and_refuses_bad_values(tiny_checkpoint):
    from xlm.config import CacheConfig

    base = tiny_checkpoint("llama")
    # Sizing only: no step runs, so no program is compiled ("used": each when a step needs it).
    engine = {k: v for k, v in TINY_ENGINE.items() if k != "num_gpu_blocks_override"}
    engine["startup_programs"] = "used"
    blocks = {}
    for kv_dtype in ("float32", "bfloat16", "fp8"):
        llm = xlm.LLM(model=base, kv_cache_dtype=kv_dtype, kv_cache_memory=0.01, **engine)
        blocks[kv_dtype] = worker_of(llm).config.cache_config.num_blocks
        llm.llm_engine.engine_core.shutdown()
    # The same memory holds 2x the blocks in 2 bytes and 4x in 1 byte (give or take one).
    assert abs(blocks["bfloat16"] - 2 * blocks["float32"]) <= 2
    assert abs(blocks["fp8"] - 4 * blocks["float32"]) <= 4
    with pytest.raises(ValueError, match="cache_dtype='int4'.*fp8_e5m2"):
        CacheConfig(cache_dtype="int4")
