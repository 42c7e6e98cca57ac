"""Plain-jnp ragged paged attention: the definition the kernels are tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .kv_quant import cache_row_width, dequantize, quantize

# Large finite negative: exp() of it underflows to 0 without producing NaN on fully masked rows.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
) -> tuple[int, ...]:
    """Shape of the shared paged KV cache: (2, num_blocks, block_size, num_kv_heads, row),
    row = head_dim (head_dim + 4 for int8: each row carries its scale, see kv_quant)."""
    return (2, num_blocks, block_size, num_kv_heads, cache_row_width(head_dim, dtype))


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter k, v [T, Hkv, D] into the cache at slot = block_id * block_size + offset."""
    kv_cache = jnp.asarray(kv_cache)
    num_blocks, block_size = kv_cache.shape[1:3]
    kv = quantize(jnp.stack([k, v]), kv_cache.dtype)
    slot_mapping = jnp.asarray(slot_mapping, jnp.int32)
    # Negative slots are dropped too (jnp would wrap them to the last block).
    blocks = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    # Index (block, offset) directly: scattering through a flattening reshape made XLA copy
    # the whole (donated) cache every step once attention also read it (~50x slower on CPU).
    return kv_cache.at[:, blocks, slot_mapping % block_size].set(
        kv, mode="drop", unique_indices=False
    )


def token_metadata(
    query_start_loc: jax.Array, seq_lens: jax.Array, num_seqs: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: (request index, absolute position in its context, is-a-real-token)."""
    qsl = query_start_loc.astype(jnp.int32)
    num_reqs = seq_lens.shape[0]
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(qsl[1:], tokens, side="right").astype(jnp.int32)
    req = jnp.minimum(req, num_reqs - 1)
    n = jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32)
    valid = tokens < qsl[n]
    q_len = qsl[req + 1] - qsl[req]
    pos = seq_lens.astype(jnp.int32)[req] - q_len + (tokens - qsl[req])
    return req, pos, valid


def ragged_paged_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention of each query row over its request's paged context, causal, in float32."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    req, pos, valid = token_metadata(query_start_loc, seq_lens, num_seqs, num_tokens)

    # Every token gathers its request's whole (padded) context: simple, dense, memory hungry.
    pages = block_tables.astype(jnp.int32)[req]  # [T, max_blocks]
    ctx = pages.shape[1] * block_size
    k = dequantize(kv_cache[0][pages], jnp.float32).reshape(num_tokens, ctx, num_kv_heads, head_dim)
    v = dequantize(kv_cache[1][pages], jnp.float32).reshape(num_tokens, ctx, num_kv_heads, head_dim)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    logits = jnp.einsum("tkgd,tlkd->tkgl", qg, k, precision=jax.lax.Precision.HIGHEST)
    logits = logits * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    kv_pos = jnp.arange(ctx, dtype=jnp.int32)[None, :]
    mask = kv_pos <= pos[:, None]
    if sliding_window is not None:
        mask &= kv_pos > pos[:, None] - sliding_window
    mask &= valid[:, None]
    logits = jnp.where(mask[:, None, None, :], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs, v, precision=jax.lax.Precision.HIGHEST)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def q_block_schedule(
    query_start_loc: jax.Array, num_seqs: jax.Array, block_q: int, num_q_blocks: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The GPU kernels' work split: each request's new tokens cut into blocks of `block_q`.
    For each query-block program: (request index, first row within the request); and per
    request: (new tokens, index of its first block). Programs past the last real block get a
    start row of 2**30, i.e. no rows."""
    qsl = query_start_loc.astype(jnp.int32)
    num_reqs = qsl.shape[0] - 1
    n = jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32)
    q_lens = jnp.where(jnp.arange(num_reqs) < n, qsl[1:] - qsl[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    g = jnp.arange(num_q_blocks, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(ends, g, side="right"), num_reqs - 1).astype(jnp.int32)
    first_row = (g - (ends[req] - blocks[req])) * block_q
    first_row = jnp.where(g < ends[-1], first_row, 1 << 30).astype(jnp.int32)
    return req, first_row, q_lens, (ends - blocks).astype(jnp.int32)
