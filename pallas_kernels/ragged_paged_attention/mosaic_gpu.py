"""Ragged paged attention for Hopper GPUs: a Pallas Mosaic GPU kernel over the shared cache layout.

Work split: like the Triton kernel, the query rows of each request are cut into blocks of
`block_q` tokens and one program (one warpgroup, 128 threads) handles one (query block, kv head,
kv split), computing the block's `block_q * group` (token, head) rows of that kv head at once as
the M = 64 rows of Hopper's wgmma. The rows are packed by XLA before the kernel (one gather: a
block's rows are not one rectangle of `q` when group > 1) and unpacked after it, so the kernel
moves whole tiles with TMA. Each program walks the pages its rows can see (causal and
sliding-window bounds) in tiles of `block_kv` tokens, one TMA copy per page straight from the
cache into shared memory, with an online softmax; S = Q K^T and P V run on the tensor cores.

Pipelining: `num_stages` shared-memory buffers per K and V; the copies of tile t + stages - 1
are issued before tile t is computed, so the page copies of the next tiles overlap this tile's
matmuls and softmax (an mbarrier per buffer tracks each tile's bytes).

Numerics: bfloat16 and float16 queries multiply in their dtype (the cache widened or rounded to
it, as the Triton kernel does) with float32 accumulation. Float32 queries run as three
bfloat16 parts (x = x0 + x1 + x2, 24 significant bits) with the six products of parts whose
rounding error matters (i + j <= 2): wgmma has no IEEE float32 mode (TF32 only, 1e-3 off the
reference on an H200 in the Triton kernel), and this keeps float32 results ~1e-6 off.

With `num_kv_splits > 1` (flash-decoding) a small jnp epilogue merges the partial softmax states.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .mosaic_gpu_plan import (
    ROWS,
    make_config,
    pack_queries,
    packed_rows,
    product_pairs,
    split_parts,
)
from .reference import MASK_VALUE, q_block_schedule, token_metadata


def _transforms(dtype, minor: int) -> tuple:
    """Tiling and swizzle of an SMEM tile whose rows hold `minor` elements of `dtype`."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _smem(shape: tuple[int, ...], dtype):
    return plgpu.SMEM(shape, dtype, transforms=_transforms(dtype, shape[-1]))


def _kernel(blk_req_ref, blk_row_ref, qsl_ref, seq_lens_ref, bt_ref, q_ref, kv_ref, *out_refs, c):
    g, kvh, split = lax.axis_index("q"), lax.axis_index("kv_head"), lax.axis_index("split")
    req = blk_req_ref[g]
    row0 = blk_row_ref[g]
    q_start = qsl_ref[req]
    q_len = qsl_ref[req + 1] - q_start
    ctx_start = seq_lens_ref[req] - q_len  # position of the request's first new token
    num_rows = jnp.minimum(jnp.maximum(q_len - row0, 0), c.block_q)

    # KV tiles visible to this block's rows, then this split's share of them.
    hi = ctx_start + row0 + num_rows - 1
    lo = 0 if c.sliding_window is None else jnp.maximum(ctx_start + row0 - c.sliding_window + 1, 0)
    first_tile = lax.div(lo, c.block_kv)
    num_tiles = jnp.where(num_rows > 0, lax.div(hi, c.block_kv) - first_tile + 1, 0)
    per_split = lax.div(num_tiles + c.num_splits - 1, c.num_splits)
    t_begin = first_tile + jnp.minimum(split * per_split, num_tiles)
    t_end = first_tile + jnp.minimum((split + 1) * per_split, num_tiles)
    n = t_end - t_begin

    def layout(x, kind):
        # The interpreter has no rule for layout casts; they only guide Mosaic's lowering.
        return x if c.interpret else plgpu.layout_cast(x, kind)

    def iota(dim):
        return layout(lax.broadcasted_iota(jnp.int32, (ROWS, c.block_kv), dim), plgpu.Layout.WGMMA)

    tok = lax.div(iota(0), c.group)
    row_ok = tok < num_rows
    q_pos = ctx_start + row0 + tok
    col = iota(1)

    def mma(a_parts, b_parts, transpose_b: bool, n_cols: int):
        """sum of a_i @ b_j (b_j^T with `transpose_b`) over the parts' product_pairs: the
        float32 [64, n_cols] product of the (split) operands in shared memory."""
        pairs = product_pairs(len(a_parts), len(b_parts))
        if c.interpret:  # the interpreter's wgmma takes no transposed operands
            a_vals, b_vals = [a[...] for a in a_parts], [b[...] for b in b_parts]
            dims = ((1,), (1,)) if transpose_b else ((1,), (0,))
            out = jnp.zeros((ROWS, n_cols), jnp.float32)
            for i, j in pairs:
                out += lax.dot_general(
                    a_vals[i], b_vals[j], (dims, ((), ())), preferred_element_type=jnp.float32
                )
            return out

        def scope(acc_ref):
            for i, j in pairs:
                b = plgpu.transpose_ref(b_parts[j], (1, 0)) if transpose_b else b_parts[j]
                plgpu.wgmma(acc_ref, a_parts[i], b)
            return acc_ref[...]

        return pl.run_scoped(scope, plgpu.ACC((ROWS, n_cols), jnp.float32))

    def main(q_smem, k_buf, v_buf, kv_ops, p_smem, q_bar, k_bar, v_bar):
        # One barrier: jax 0.10 gives it shape (1,), jax 0.11 shape () (seen on an H200:
        # `.at[0]` of it fails there).
        q_bar = q_bar if q_bar.shape == () else q_bar.at[0]
        for i in range(c.q_parts):
            plgpu.copy_gmem_to_smem(q_ref.at[i, g, kvh], q_smem.at[i, pl.ds(0, c.rows)], q_bar)

        def issue(t, slot):
            """TMA copies of tile t's pages (K and V) into buffer `slot`."""
            for p in range(c.pages_per_tile):
                page = bt_ref[req, jnp.minimum(t * c.pages_per_tile + p, c.max_pages - 1)]
                rows = pl.ds(p * c.block_size, c.block_size)
                for plane, buf, bar in ((0, k_buf, k_bar), (1, v_buf, v_bar)):
                    src = kv_ref.at[plane * c.num_blocks + page, :, kvh, :]
                    plgpu.copy_gmem_to_smem(src, buf.at[slot, rows], bar.at[slot])

        for s in range(c.num_stages - 1):
            pl.when(s < n)(functools.partial(issue, t_begin + s, s))

        q_parts = [q_smem.at[j] for j in range(c.q_parts)]
        p_parts = [p_smem.at[j] for j in range(c.q_parts)]

        def operands(buf, slot):
            """The wgmma operand refs of a K or V tile: the copied tile itself, or its
            conversion (widened / rounded / split) written to `kv_ops`."""
            if c.direct:
                return [buf.at[slot]]
            x = buf[slot].astype(jnp.float32)
            parts = split_parts(x, c.kv_parts, c.compute_dtype)
            for j, part in enumerate(parts):
                kv_ops[j] = part
            plgpu.commit_smem()  # make the stores visible to wgmma (the async proxy)
            return [kv_ops.at[j] for j in range(c.kv_parts)]

        def body(i, carry):
            acc, m_prev, l_prev = carry
            t = t_begin + i
            slot = lax.rem(i, c.num_stages)
            ahead = i + c.num_stages - 1

            @pl.when(ahead < n)
            def _():
                issue(t_begin + ahead, lax.rem(ahead, c.num_stages))

            plgpu.barrier_wait(k_bar.at[slot])
            k = operands(k_buf, slot)
            s = mma(q_parts, k, True, c.block_kv)
            s = s * c.sm_scale
            if c.soft_cap is not None:
                s = c.soft_cap * jnp.tanh(s / c.soft_cap)
            col_pos = t * c.block_kv + col
            mask = row_ok & (col_pos <= q_pos)
            if c.sliding_window is not None:
                mask &= col_pos > q_pos - c.sliding_window
            s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m_prev, s.max(axis=1))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            l_new = alpha * l_prev + p.sum(axis=1)

            plgpu.barrier_wait(v_bar.at[slot])
            v = operands(v_buf, slot)
            for j, part in enumerate(split_parts(p, c.q_parts, c.compute_dtype)):
                p_smem[j] = part
            plgpu.commit_smem()
            pv = mma(p_parts, v, False, c.head_dim)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
            return acc, m_new, l_new

        acc = layout(jnp.zeros((ROWS, c.head_dim), jnp.float32), plgpu.Layout.WGMMA)
        row = plgpu.Layout.WGMMA.reduce(1)
        m_i = layout(jnp.full((ROWS,), MASK_VALUE, jnp.float32), row)
        l_i = layout(jnp.zeros((ROWS,), jnp.float32), row)
        plgpu.barrier_wait(q_bar)
        return lax.fori_loop(0, n, body, (acc, m_i, l_i))

    buf_dtype = c.compute_dtype if c.direct else c.cache_dtype
    kv_tile = (c.num_stages, c.block_kv, c.head_dim)
    acc, m_i, l_i = pl.run_scoped(
        main,
        _smem((c.q_parts, ROWS, c.head_dim), c.compute_dtype),
        _smem(kv_tile, buf_dtype),
        _smem(kv_tile, buf_dtype),
        None if c.direct else _smem((c.kv_parts, c.block_kv, c.head_dim), c.compute_dtype),
        _smem((c.q_parts, ROWS, c.block_kv), c.compute_dtype),
        plgpu.Barrier(num_arrivals=c.q_parts),
        plgpu.Barrier(num_arrivals=c.pages_per_tile, num_barriers=c.num_stages),
        plgpu.Barrier(num_arrivals=c.pages_per_tile, num_barriers=c.num_stages),
    )

    # The output goes through shared memory the loop's buffers no longer use.
    def store(o_smem, m_smem, l_smem):
        rows = pl.ds(0, c.rows)
        if c.num_splits == 1:
            (o_ref,) = out_refs
            denom = jnp.where(l_i > 0, l_i, 1.0)
            o_smem[...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(c.out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[g, kvh])
        else:
            o_ref, m_ref, l_ref = out_refs
            o_smem[...] = acc
            m_smem[...] = m_i
            l_smem[...] = l_i
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[split, g, kvh])
            plgpu.copy_smem_to_gmem(m_smem.at[rows], m_ref.at[split, g, kvh])
            plgpu.copy_smem_to_gmem(l_smem.at[rows], l_ref.at[split, g, kvh])
        plgpu.wait_smem_to_gmem(0)

    vec = None if c.num_splits == 1 else plgpu.SMEM((ROWS,), jnp.float32)
    pl.run_scoped(store, _smem((ROWS, c.head_dim), c.out_dtype), vec, vec)


def _interpret_params(interpret):
    """Mosaic GPU's CPU interpreter (simulated shared memory, barriers and TMA), or None.

    `interpret` is True or the interpreter's own parameters (an InterpretGPUParams, e.g. with
    detect_races=True); jax has the interpreter since 0.10, under a private name only."""
    if not interpret:
        return None
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - older or newer jax
        raise NotImplementedError(
            f"interpret=True needs Mosaic GPU's interpreter, not found in jax {jax.__version__}"
        ) from e
    return interpret if isinstance(interpret, InterpretGPUParams) else InterpretGPUParams()


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
        "num_stages",
    ),
)
def ragged_paged_attention_mosaic_gpu(
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
    interpret: bool | Any = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_kv_splits: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """Pallas Mosaic GPU (Hopper) ragged paged attention over the shared (2, NB, BS, Hkv, D)
    cache. `interpret` (True, or an InterpretGPUParams) runs it in Mosaic GPU's CPU interpreter."""
    c = make_config(
        q,
        kv_cache,
        block_tables,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
        block_q=block_q,
        block_kv=block_kv,
        num_kv_splits=num_kv_splits,
        num_stages=num_stages,
    )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    qsl = query_start_loc.astype(jnp.int32)

    # sum over requests of ceil(q_len / block_q) <= (T + n * (block_q - 1)) / block_q, with
    # n <= min(R, T) requests holding tokens: programs beyond it would find no rows.
    num_q_blocks = (num_tokens + min(num_reqs, num_tokens) * (c.block_q - 1)) // c.block_q
    blk_req, blk_row, q_lens, block_start = q_block_schedule(qsl, num_seqs, c.block_q, num_q_blocks)
    q_packed = pack_queries(q, qsl, blk_req, blk_row, q_lens, c, num_kv_heads)
    packed = (num_q_blocks, num_kv_heads, c.rows)
    if c.num_splits == 1:
        out_type = jax.ShapeDtypeStruct((*packed, head_dim), c.out_dtype)
    else:
        s = c.num_splits
        out_type = (
            jax.ShapeDtypeStruct((s, *packed, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((s, *packed), jnp.float32),
            jax.ShapeDtypeStruct((s, *packed), jnp.float32),
        )

    def ragged_paged_attention_mgpu(*refs):  # named: the name the profiler and ptxas show
        _kernel(*refs, c=c)

    result = plgpu.kernel(
        ragged_paged_attention_mgpu,
        out_type=out_type,
        grid=(num_q_blocks, num_kv_heads, c.num_splits),
        grid_names=("q", "kv_head", "split"),
        interpret=_interpret_params(interpret),
    )(
        blk_req,
        blk_row,
        qsl,
        seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        q_packed,
        kv_cache.reshape(2 * c.num_blocks, c.block_size, num_kv_heads, head_dim),
    )
    req, _, valid = token_metadata(query_start_loc, seq_lens, num_seqs, num_tokens)
    g, h, m = packed_rows(qsl, block_start, c, req, num_q_blocks, num_q_heads)
    if c.num_splits == 1:
        out = result[g, h, m]
    else:
        acc, m_part, l_part = (x[:, g, h, m] for x in result)
        m_max = m_part.max(axis=0)
        w = jnp.exp(m_part - m_max[None])
        denom = (w * l_part).sum(axis=0)
        out = (w[..., None] * acc).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]
    # Rows past query_start_loc[num_seqs] are never computed: define them as 0.
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
