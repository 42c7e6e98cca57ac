"""Native paged attention against a brute-force numpy per-request attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.paged_batch import BlockAllocator, StepRequest, build_metadata
from xlm.ops.paged_attention import (
    PagedAttention,
    choose_query_chunk,
    kv_cache_shape,
    ragged_paged_attention,
    write_kv,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEAD_DIM = 8


def reference_attention(q, keys, values, num_computed, scale, window, soft_cap):
    """q [n, Hq, D] at positions num_computed.., keys/values [ctx, Hkv, D]."""
    hq, hkv = q.shape[1], keys.shape[1]
    k = np.repeat(keys, hq // hkv, axis=1)
    v = np.repeat(values, hq // hkv, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k).astype(np.float64) * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    qpos = num_computed + np.arange(q.shape[0])[:, None]
    kpos = np.arange(keys.shape[0])[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


# (num_computed, num_new) per request: full prompts, mid-page chunks, decodes.
BATCHES = [
    [(0, 7), (5, 6), (9, 1), (0, 1), (13, 1), (3, 9)],
    [(0, 1), (6, 1), (11, 1), (2, 1)],  # pure decode
    [(0, 17)],  # one prefill
    [(4, 3), (0, 12), (21, 1)],
]


def run_case(reqs_spec, num_heads, num_kv_heads, window, soft_cap, query_chunk, seed):
    rng = np.random.default_rng(seed)
    alloc = BlockAllocator(NUM_BLOCKS, seed)
    cache = np.zeros(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM), np.float32)
    reqs, ctx_k, ctx_v = [], [], []
    for computed, new in reqs_spec:
        total = computed + new
        table = alloc.allocate(-(-total // BLOCK_SIZE) + int(rng.integers(0, 2)))
        k = rng.standard_normal((total, num_kv_heads, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((total, num_kv_heads, HEAD_DIM)).astype(np.float32)
        for p in range(computed):  # the already-cached part of the context
            blk, off = table[p // BLOCK_SIZE], p % BLOCK_SIZE
            cache[0, blk, off], cache[1, blk, off] = k[p], v[p]
        reqs.append(StepRequest(table, computed, new))
        ctx_k.append(k)
        ctx_v.append(v)
    total_new = sum(n for _, n in reqs_spec)
    md = build_metadata(
        reqs, BLOCK_SIZE, num_tokens=total_new + 3, num_reqs=len(reqs) + 2, max_blocks=8
    )
    q = rng.standard_normal((total_new + 3, num_heads, HEAD_DIM)).astype(np.float32)
    new_k = np.zeros((total_new + 3, num_kv_heads, HEAD_DIM), np.float32)
    new_v = np.zeros_like(new_k)
    start = 0
    for (computed, new), k, v in zip(reqs_spec, ctx_k, ctx_v):
        new_k[start : start + new], new_v[start : start + new] = k[computed:], v[computed:]
        start += new
    scale = HEAD_DIM**-0.5

    @jax.jit
    def step(q, k, v, cache, md):
        cache = write_kv(cache, k, v, md.slot_mapping)
        out = ragged_paged_attention(
            q,
            cache,
            md,
            scale=scale,
            sliding_window=window,
            logits_soft_cap=soft_cap,
            query_chunk=query_chunk,
        )
        return out, cache

    out, new_cache = step(q, new_k, new_v, jnp.asarray(cache), md)
    out = np.asarray(out)
    assert np.isfinite(out).all()
    start = 0
    for (computed, new), k, v in zip(reqs_spec, ctx_k, ctx_v):
        ref = reference_attention(q[start : start + new], k, v, computed, scale, window, soft_cap)
        np.testing.assert_allclose(out[start : start + new], ref, rtol=1e-5, atol=1e-5)
        start += new
    return np.asarray(new_cache), {b for r in reqs for b in r.block_table}


# The mixed batch at every GQA group (1 / 4 / 8: 8, 2, 1 KV heads for 8 query heads); each
# other batch at one group, every group once among them.
@pytest.mark.parametrize("batch,num_kv_heads", [(0, 8), (0, 2), (0, 1), (1, 1), (2, 8), (3, 2)])
def test_matches_reference(batch, num_kv_heads):
    run_case(BATCHES[batch], 8, num_kv_heads, None, None, None, seed=batch)


@pytest.mark.parametrize("query_chunk", [1, 4])
def test_any_query_chunk_matches(query_chunk):
    run_case(BATCHES[0], 8, 2, None, None, query_chunk, seed=1)
    run_case(BATCHES[3], 8, 2, None, None, query_chunk, seed=2)


@pytest.mark.parametrize(
    "window,soft_cap,query_chunk", [(5, None, None), (None, 2.0, 2), (3, 5.0, None)]
)
def test_sliding_window_and_soft_cap(window, soft_cap, query_chunk):
    run_case(BATCHES[0], 4, 2, window, soft_cap, query_chunk, seed=7)
    run_case(BATCHES[3], 4, 2, window, soft_cap, query_chunk, seed=8)


def test_writes_only_owned_pages_and_the_null_block():
    cache, owned = run_case(BATCHES[0], 4, 2, None, None, None, seed=3)
    touched = set(np.nonzero(np.any(cache != 0, axis=(0, 2, 3, 4)))[0].tolist())
    assert touched - {0} <= owned
    assert touched & owned


def test_op_writes_cache_and_attends():
    op = PagedAttention(4, 2, HEAD_DIM, HEAD_DIM**-0.5)
    reqs = [StepRequest([3, 5], 0, 6)]
    md = build_metadata(reqs, BLOCK_SIZE)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 4, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((6, 2, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((6, 2, HEAD_DIM)).astype(np.float32)
    cache = jnp.zeros(op.kv_cache_shape(8, BLOCK_SIZE))
    # Jitted as in a model step (one compile, not one per op run eagerly).
    out, cache = jax.jit(op.forward_native)(q, k, v, cache, md)
    np.testing.assert_array_equal(np.asarray(cache)[0, 3], k[:4])
    np.testing.assert_array_equal(np.asarray(cache)[1, 5, :2], v[4:])
    ref = reference_attention(q, k, v, 0, HEAD_DIM**-0.5, None, None)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size",
    [(130, 2, BLOCK_SIZE), (4, 2, 512)],  # 65 query heads per KV head; pages of 512
)
def test_cpu_path_past_the_kernels_limits_matches_reference(
    on_platform, num_heads, num_kv_heads, block_size
):
    from xlm.platforms.cpu import CpuPlatform

    on_platform(CpuPlatform)
    op = PagedAttention(num_heads, num_kv_heads, HEAD_DIM, HEAD_DIM**-0.5)
    assert op._forward_name == "forward_cpu"
    md = build_metadata([StepRequest([1, 2, 3], 0, 9)], block_size, max_blocks=3)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((9, num_heads, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((9, num_kv_heads, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((9, num_kv_heads, HEAD_DIM)).astype(np.float32)
    cache = jnp.zeros(op.kv_cache_shape(4, block_size))
    out, _ = jax.jit(op)(q, k, v, cache, md)
    ref = reference_attention(q, k, v, 0, HEAD_DIM**-0.5, None, None)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_chunk_choice_per_token_for_decode_and_wide_for_prefill():
    assert choose_query_chunk(64, 64, 1024, 9, 3) == 1
    assert choose_query_chunk(512, 1, 1024, 9, 3) > 1


def test_negative_slots_write_nowhere():
    cache = jnp.zeros(kv_cache_shape(4, BLOCK_SIZE, 1, 2))
    k = jnp.ones((2, 1, 2))
    out = np.asarray(write_kv(cache, k, k, jnp.array([-1, 5], jnp.int32)))
    assert out[:, 1, 1].sum() == 4 and out.sum() == 4  # only slot 5 = block 1, offset 1


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("span", [(2, 6), None])  # positions attended both ways; None: causal
def test_attend_until_opens_a_bidirectional_span(on_platform, window, span):
    """Gemma 3's image tokens: a token of the span sees up to the span's last key (and
    keeps its sliding window); the kernel path falls back to the jnp one for such a step."""
    import dataclasses

    from xlm.platforms.cpu import CpuPlatform

    on_platform(CpuPlatform)
    op = PagedAttention(4, 2, HEAD_DIM, HEAD_DIM**-0.5, sliding_window=window)
    md = build_metadata([StepRequest([1, 2, 3], 0, 9)], BLOCK_SIZE, max_blocks=3)
    limit = np.asarray(md.positions).copy()
    if span is not None:
        limit[span[0] : span[1]] = span[1] - 1
    md = dataclasses.replace(md, attend_until=jnp.asarray(limit))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((9, 4, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((9, 2, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((9, 2, HEAD_DIM)).astype(np.float32)
    cache = jnp.zeros(op.kv_cache_shape(4, BLOCK_SIZE))
    out, _ = jax.jit(op)(q, k, v, cache, md)
    # numpy reference: key j visible to query i when j <= limit[i] and within the window.
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk).astype(np.float64) * HEAD_DIM**-0.5
    qpos, kpos = np.arange(9)[:, None], np.arange(9)[None, :]
    mask = kpos <= limit[:, None]
    if window is not None:
        mask &= kpos > qpos - window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
