"""Ragged paged attention for NVIDIA GPUs: a Pallas Triton kernel over the shared cache layout.

Work split: the query rows of each request are cut into blocks of `block_q` tokens; one program
handles one (query block, kv head, kv split) and computes all `Hq // Hkv` query heads of that kv
head at once, so a K/V tile is loaded once per head group. Rows are (token, head) pairs padded to
a power of two >= 16 (tensor-core minimum). Each program walks the pages its rows can see (causal
and sliding-window bounds) in tiles of `block_kv` tokens with an online softmax. With
`num_kv_splits > 1` (flash-decoding) each program covers a slice of those tiles and a small jnp
epilogue merges the partial softmax states; this keeps the GPU busy on small decode batches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .kv_quant import SCALE_BYTES, is_int8, scale_of
from .reference import MASK_VALUE, q_block_schedule, token_metadata

_MIN_ROWS = 16  # smallest M for tl.dot
# The smallest K of a 16-bit tl.dot (the P @ V product contracts over block_kv). On an H200
# a bfloat16 kernel with block_kv=8 returned exactly twice the reference: the 8-wide operand
# was repeated to fill the MMA tile (interpret mode cannot show it).
_MIN_BLOCK_KV = 16
# Float32 queries get IEEE products: Triton's default for float32 dots is TF32 (10-bit
# mantissas), which put the H200's float32 results 1e-3 off the reference. Other dtypes are
# unaffected (their products are exact in the float32 accumulator).
_PRECISION = lax.Precision.HIGHEST


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _kernel(
    blk_req_ref,
    blk_row_ref,
    qsl_ref,
    seq_lens_ref,
    bt_ref,
    q_ref,
    kv_ref,
    *out_refs,
    sm_scale,
    sliding_window,
    soft_cap,
    group,
    num_q_heads,
    block_q,
    rows,
    block_kv,
    block_size,
    kv_plane,
    num_splits,
    dummy_row,
):
    g, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    req = blk_req_ref[g]
    row0 = blk_row_ref[g]
    q_start = qsl_ref[req]
    q_len = qsl_ref[req + 1] - q_start
    ctx_start = seq_lens_ref[req] - q_len  # position of the request's first new token
    num_rows = jnp.clip(q_len - row0, 0, block_q)

    m_idx = lax.iota(jnp.int32, rows)
    tok = m_idx // group
    row_valid = (m_idx < block_q * group) & (tok < num_rows)
    q_pos = ctx_start + row0 + tok
    flat_row = (q_start + row0 + tok) * num_q_heads + kvh * group + m_idx % group
    # Padding rows read row 0 and write to the spare last output row: masked-off lanes must not
    # alias real rows, since interpret mode emulates masked stores with read-modify-write.
    load_row = jnp.where(row_valid, flat_row, 0)
    store_row = jnp.where(row_valid, flat_row, dummy_row)
    head_dim = q_ref.shape[1]
    # Full integer-array indices (no slices): the form both Triton lowering and interpret take.
    q_rows = jnp.broadcast_to(load_row[:, None], (rows, head_dim))
    o_rows = jnp.broadcast_to(store_row[:, None], (rows, head_dim))
    q_cols = jnp.broadcast_to(lax.iota(jnp.int32, head_dim)[None, :], (rows, head_dim))
    q = q_ref[q_rows, q_cols]

    # KV tiles visible to this block's rows, then this split's share of them.
    hi = ctx_start + row0 + num_rows - 1
    lo = 0 if sliding_window is None else jnp.maximum(ctx_start + row0 - sliding_window + 1, 0)
    first_tile = lo // block_kv
    num_tiles = jnp.where(num_rows > 0, hi // block_kv - first_tile + 1, 0)
    per_split = (num_tiles + num_splits - 1) // num_splits
    t_begin = first_tile + jnp.minimum(split * per_split, num_tiles)
    t_end = first_tile + jnp.minimum((split + 1) * per_split, num_tiles)

    max_pages = bt_ref.shape[1]
    kv_cols = jnp.broadcast_to(lax.iota(jnp.int32, head_dim)[None, :], (block_kv, head_dim))
    int8 = is_int8(kv_ref.dtype)
    scale_cols = head_dim + lax.iota(jnp.int32, SCALE_BYTES)[None, :]

    def load_rows(slot, ok):
        """K or V rows [block_kv, head_dim] at cache rows `slot` (where `ok`), in the queries'
        dtype: an fp8 cache widened, an int8 one as codes * scale."""
        rows = jnp.broadcast_to(slot[:, None], (block_kv, head_dim))
        mask = jnp.broadcast_to(ok[:, None], (block_kv, head_dim))
        x = plgpu.load(kv_ref.at[rows, kvh, kv_cols], mask=mask, other=0)
        if not int8:
            return x.astype(q.dtype)
        shape = (block_kv, SCALE_BYTES)
        scale_bytes = plgpu.load(
            kv_ref.at[
                jnp.broadcast_to(slot[:, None], shape), kvh, jnp.broadcast_to(scale_cols, shape)
            ],
            mask=jnp.broadcast_to(ok[:, None], shape),
            other=0,
        )
        return (x.astype(jnp.float32) * scale_of(scale_bytes)[:, None]).astype(q.dtype)

    def body(t, carry):
        acc, m_prev, l_prev = carry
        col_pos = t * block_kv + lax.iota(jnp.int32, block_kv)
        col_ok = (col_pos <= hi) & (col_pos >= lo)
        page = bt_ref[req, jnp.minimum(col_pos // block_size, max_pages - 1)]
        slot = jnp.where(col_ok, page * block_size + col_pos % block_size, 0)
        k = load_rows(slot, col_ok)
        v = load_rows(slot + kv_plane, col_ok)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=_PRECISION, preferred_element_type=jnp.float32
        )
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = row_valid[:, None] & col_ok[None, :] & (col_pos[None, :] <= q_pos[:, None])
        if sliding_window is not None:
            mask &= col_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, s.max(axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = alpha * l_prev + p.sum(axis=1)
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=_PRECISION,
            preferred_element_type=jnp.float32,
        )
        return acc * alpha[:, None] + pv, m_new, l_new

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m_i = jnp.full((rows,), MASK_VALUE, jnp.float32)
    l_i = jnp.zeros((rows,), jnp.float32)
    acc, m_i, l_i = lax.fori_loop(t_begin, t_end, body, (acc, m_i, l_i))

    store_mask = jnp.broadcast_to(row_valid[:, None], (rows, head_dim))
    if num_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(o_ref.at[o_rows, q_cols], out.astype(o_ref.dtype), mask=store_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[split, o_rows, q_cols], acc, mask=store_mask)
        plgpu.store(m_ref.at[split, store_row], m_i, mask=row_valid)
        plgpu.store(l_ref.at[split, store_row], l_i, mask=row_valid)


def default_knobs(
    num_tokens: int, num_reqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> dict[str, int]:
    """Block sizes picked from static shapes: decode-like buckets (T <= R) get flash-decoding."""
    group = num_q_heads // num_kv_heads
    decode_like = num_tokens <= num_reqs
    block_q = 1 if decode_like else max(1, 64 // group)
    splits = min(16, max(1, 256 // (num_reqs * num_kv_heads))) if decode_like else 1
    return dict(block_q=block_q, block_kv=64 if head_dim <= 128 else 32, num_kv_splits=splits)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "interpret",
        "block_q",
        "block_kv",
        "num_kv_splits",
        "num_warps",
        "num_stages",
    ),
)
def ragged_paged_attention_gpu(
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
    interpret: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Pallas Triton ragged paged attention over the shared (2, NB, BS, Hkv, row) cache."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, row = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for the Triton kernel, got {head_dim}")
    knobs = default_knobs(num_tokens, num_reqs, num_q_heads, num_kv_heads, head_dim)
    block_q = block_q or knobs["block_q"]
    block_kv = block_kv or knobs["block_kv"]
    num_splits = num_kv_splits or knobs["num_kv_splits"]
    if block_kv & (block_kv - 1) or block_kv < _MIN_BLOCK_KV:
        raise ValueError(f"block_kv must be a power of two >= {_MIN_BLOCK_KV}, got {block_kv}")
    rows = max(_MIN_ROWS, _next_pow2(block_q * group))

    num_q_blocks = pl.cdiv(num_tokens, block_q) + num_reqs
    blk_req, blk_row, _, _ = q_block_schedule(query_start_loc, num_seqs, block_q, num_q_blocks)
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        group=group,
        num_q_heads=num_q_heads,
        block_q=block_q,
        rows=rows,
        block_kv=block_kv,
        block_size=block_size,
        kv_plane=num_blocks * block_size,
        num_splits=num_splits,
        dummy_row=num_tokens * num_q_heads,
    )
    flat_rows = num_tokens * num_q_heads + 1  # + the spare row padding lanes write to
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((flat_rows, head_dim), q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((num_splits, flat_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, flat_rows), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, flat_rows), jnp.float32),
        )
    result = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, num_kv_heads, num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="ragged_paged_attention_gpu",
    )(
        blk_req,
        blk_row,
        query_start_loc.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        q.reshape(flat_rows - 1, head_dim),
        kv_cache.reshape(2 * num_blocks * block_size, num_kv_heads, row),
    )
    if num_splits == 1:
        out = result[:-1]
    else:
        acc, m_part, l_part = (x[:, :-1] for x in result)
        m_max = m_part.max(axis=0)
        w = jnp.exp(m_part - m_max[None])
        denom = (w * l_part).sum(axis=0)
        out = (w[..., None] * acc).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[:, None]
    # Rows past query_start_loc[num_seqs] are never written: define them as 0.
    _, _, valid = token_metadata(query_start_loc, seq_lens, num_seqs, num_tokens)
    out = out.reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
