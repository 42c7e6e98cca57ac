"""Ragged paged attention for TPU: a Pallas Mosaic kernel with its own KV cache layout.

TPU layout: (2, num_blocks, num_kv_heads, block_size, row), row = head_dim padded to at least
the 128 lanes (`tpu_row_width`). One kv head's page is then a contiguous, (8, 128)-tiled
[block_size, row] slab, so a page DMA lands in VMEM ready for
the MXU. The shared layout (..., block_size, num_kv_heads, head_dim) would tile (Hkv, D) and pad
Hkv up to 8 (16 for bf16) sublanes in HBM whenever Hkv is small, wasting memory and bandwidth.

Work split: grid (kv head, query block). Query blocks are aligned runs of `block_q` tokens of the
flat batch and may span several requests; the kernel loops over the requests overlapping its
block and, for each, over the KV tiles (`pages_per_tile` pages) those rows can see, DMA-ing tile
i+1 from HBM while computing tile i (double buffering). Online softmax state lives in VMEM
scratch; rows of other requests are masked and keep their state.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .kv_quant import cache_row_width, dequantize, quantize
from .reference import MASK_VALUE

LANES = 128  # a TPU vector register's minor dimension


def tpu_row_width(head_dim: int, dtype) -> int:
    """Elements of one cached (token, kv head) row in the TPU layout: `cache_row_width`,
    padded with zeros up to the 128 lanes when it is narrower.

    A narrower row (64-, 80- or 96-wide heads) gives the cache a shape the TPU compiler
    lays out with the blocks dimension minor (to avoid padding it in HBM), a layout
    neither the cache write nor the kernel takes: every step then copied each layer's whole
    cache twice or three times (issue 46; RESULTS.md). A full-lane row is laid out
    row-major, as the kernel reads it. Wider rows are kept as they are."""
    width = cache_row_width(head_dim, dtype)
    return max(width, LANES)


def kv_cache_shape_tpu(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
) -> tuple[int, ...]:
    """Shape of the TPU paged KV cache: (2, num_blocks, num_kv_heads, block_size, row), row =
    `tpu_row_width` (head_dim, + 4 for int8: each row carries its scale, see kv_quant; at
    least 128)."""
    return (2, num_blocks, num_kv_heads, block_size, tpu_row_width(head_dim, dtype))


def write_kv_tpu(
    kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Scatter k, v [T, Hkv, D] into the TPU-layout cache at slot = block_id * block_size + off.

    The scatter runs on the (2 * num_blocks, Hkv * block_size, row) view (a bitcast of the
    cache), one whole row per (K or V, head, position): its only window is the minor
    dimension, which the cache's row-major layout keeps contiguous. Scattering on the 5-D
    form, or with K/V as a window dimension, made the TPU compiler relayout the whole cache
    around the scatter (issue 46). Rows are written whole, padding lanes as zeros."""
    two, num_blocks, num_kv_heads, block_size, row = kv_cache.shape
    slots = slot_mapping.astype(jnp.int32)
    rows = jnp.arange(num_kv_heads)[None, :] * block_size + (slots % block_size)[:, None]
    blocks = jnp.repeat(slots // block_size, num_kv_heads)
    # K rows go to blocks [0, num_blocks), V rows to [num_blocks, 2 * num_blocks).
    blocks = jnp.concatenate([blocks, blocks + num_blocks])
    rows = jnp.tile(rows.reshape(-1), two)
    kv = quantize(jnp.stack([k, v], axis=0), kv_cache.dtype)
    kv = jnp.pad(kv, ((0, 0),) * (kv.ndim - 1) + ((0, row - kv.shape[-1]),))
    kv = kv.reshape(-1, row)
    flat = jnp.asarray(kv_cache).reshape(two * num_blocks, num_kv_heads * block_size, row)
    return flat.at[blocks, rows].set(kv, mode="drop").reshape(kv_cache.shape)


def _sublane_tile(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def default_knobs_tpu(
    num_tokens: int, num_reqs: int, num_q_heads: int, num_kv_heads: int, block_size: int, dtype
) -> dict[str, int]:
    """Block sizes from static shapes: rows (block_q * group) a multiple of the sublane tile."""
    group = num_q_heads // num_kv_heads
    tile = _sublane_tile(dtype)
    base = tile // math.gcd(tile, group)  # smallest block_q with block_q * group % tile == 0
    block_q = base if num_tokens <= num_reqs else base * max(1, 128 // (base * group))
    return dict(block_q=block_q, pages_per_tile=max(1, 128 // block_size))


def _kernel(
    # scalar prefetch (SMEM)
    seq_lens_ref,
    qsl_ref,
    block_tables_ref,
    first_req_ref,
    last_req_ref,
    # inputs / outputs
    q_ref,
    kv_hbm,
    o_ref,
    # scratch
    k_buf,
    v_buf,
    sems,
    acc_ref,
    m_ref,
    l_ref,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    group,
    block_q,
    block_size,
    pages_per_tile,
    max_pages,
    head_dim,
):
    h, g = pl.program_id(0), pl.program_id(1)
    rows = block_q * group
    tile_tokens = pages_per_tile * block_size
    blk_start = g * block_q

    acc_ref[...] = jnp.zeros_like(acc_ref)
    m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)

    row_idx = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    if group & (group - 1) == 0:
        row_tok = blk_start + (row_idx >> (group.bit_length() - 1))
    else:
        row_tok = blk_start + lax.div(row_idx, group)
    q = q_ref[...]

    def tile_copies(req, tile, slot):
        copies = []
        for j in range(pages_per_tile):
            page_idx = jnp.minimum(tile * pages_per_tile + j, max_pages - 1)
            page = block_tables_ref[req * max_pages + page_idx]
            dst = pl.ds(j * block_size, block_size)
            copies.append(
                pltpu.make_async_copy(kv_hbm.at[0, page, h], k_buf.at[slot, dst], sems.at[0, slot])
            )
            copies.append(
                pltpu.make_async_copy(kv_hbm.at[1, page, h], v_buf.at[slot, dst], sems.at[1, slot])
            )
        return copies

    def request_body(req, carry):
        q_start = qsl_ref[req]
        q_end = qsl_ref[req + 1]
        ctx_start = seq_lens_ref[req] - (q_end - q_start)
        row_lo = jnp.maximum(q_start, blk_start)
        row_hi = jnp.minimum(q_end, blk_start + block_q)
        hi = ctx_start + (row_hi - 1 - q_start)  # last position any row here attends to
        lo = 0
        if sliding_window is not None:
            lo = jnp.maximum(ctx_start + (row_lo - q_start) - sliding_window + 1, 0)
        first_tile = lo // tile_tokens
        num_tiles = jnp.where(row_hi > row_lo, hi // tile_tokens - first_tile + 1, 0)
        row_ok = (row_tok >= row_lo) & (row_tok < row_hi)
        q_pos = ctx_start + (row_tok - q_start)

        @pl.when(num_tiles > 0)
        def _():
            for c in tile_copies(req, first_tile, 0):
                c.start()

        def tile_body(i, carry):
            slot = i % 2
            tile = first_tile + i

            @pl.when(i + 1 < num_tiles)
            def _():
                for c in tile_copies(req, tile + 1, 1 - slot):
                    c.start()

            for c in tile_copies(req, tile, slot):
                c.wait()
            # An fp8 or int8 cache is widened to the queries' dtype in VMEM (a half or a
            # quarter of the HBM reads).
            k = dequantize(k_buf[slot], q.dtype, in_kernel=True, head_dim=head_dim)
            v = dequantize(v_buf[slot], q.dtype, in_kernel=True, head_dim=head_dim)
            s = (
                lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                * sm_scale
            )
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            col_pos = tile * tile_tokens + lax.broadcasted_iota(jnp.int32, (1, tile_tokens), 1)
            mask = row_ok & (col_pos <= q_pos)
            if sliding_window is not None:
                mask &= col_pos > q_pos - sliding_window
            s = jnp.where(mask, s, MASK_VALUE)
            m_prev = m_ref[...]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
            m_ref[...] = m_new
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            acc_ref[...] = acc_ref[...] * alpha + pv
            return carry

        lax.fori_loop(0, num_tiles, tile_body, 0)
        return carry

    lax.fori_loop(first_req_ref[g], last_req_ref[g] + 1, request_body, 0)
    denom = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)


def _block_request_ranges(
    query_start_loc: jax.Array, num_seqs: jax.Array, block_q: int, num_q_blocks: int
) -> tuple[jax.Array, jax.Array]:
    """First and last (inclusive) request overlapping each aligned query block."""
    qsl = query_start_loc.astype(jnp.int32)
    n = jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32)
    starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    first = jnp.searchsorted(qsl[1:], starts, side="right").astype(jnp.int32)
    last = jnp.searchsorted(qsl[1:], starts + block_q - 1, side="right").astype(jnp.int32)
    return first, jnp.minimum(last, n - 1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "interpret",
        "block_q",
        "pages_per_tile",
        "vmem_limit_bytes",
    ),
)
def ragged_paged_attention_tpu(
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
    pages_per_tile: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """Pallas Mosaic ragged paged attention over the TPU (2, NB, Hkv, BS, row) cache layout."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, block_size, row = kv_cache.shape
    # Rows padded to the lanes (tpu_row_width) are read whole: queries get zero lanes to
    # match and the output's extra lanes are dropped.
    width = row if row > cache_row_width(head_dim, kv_cache.dtype) else head_dim
    num_reqs, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    knobs = default_knobs_tpu(num_tokens, num_reqs, num_q_heads, num_kv_heads, block_size, q.dtype)
    block_q = block_q or knobs["block_q"]
    pages_per_tile = pages_per_tile or knobs["pages_per_tile"]
    rows = block_q * group
    num_q_blocks = pl.cdiv(num_tokens, block_q)
    if num_q_blocks > 1 and rows % _sublane_tile(q.dtype):
        raise ValueError(
            f"block_q * (num_q_heads // num_kv_heads) = {rows} must be a multiple of "
            f"{_sublane_tile(q.dtype)} for {jnp.dtype(q.dtype).name} on TPU; got block_q={block_q}"
        )
    padded_tokens = num_q_blocks * block_q

    # [T, Hq, D] -> [Hkv, T * group, D]: each kv head's query rows as one 2-D, tile-able slab.
    q_t = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, width - head_dim)))
    q_t = q_t.reshape(padded_tokens, num_kv_heads, group, width).transpose(1, 0, 2, 3)
    q_t = q_t.reshape(num_kv_heads, padded_tokens * group, width)
    first_req, last_req = _block_request_ranges(query_start_loc, num_seqs, block_q, num_q_blocks)

    tile_tokens = pages_per_tile * block_size
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        group=group,
        block_q=block_q,
        block_size=block_size,
        pages_per_tile=pages_per_tile,
        max_pages=max_pages,
        head_dim=head_dim,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_kv_heads, num_q_blocks),
        in_specs=[
            pl.BlockSpec((None, rows, width), lambda h, g, *_: (h, g, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((None, rows, width), lambda h, g, *_: (h, g, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, tile_tokens, row), kv_cache.dtype),
            pltpu.VMEM((2, tile_tokens, row), kv_cache.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((rows, width), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_t.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(
        seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        first_req,
        last_req,
        q_t,
        kv_cache,
    )
    out = out.reshape(num_kv_heads, padded_tokens, group, width).transpose(1, 0, 2, 3)
    return out.reshape(padded_tokens, num_q_heads, width)[:num_tokens, :, :head_dim]
