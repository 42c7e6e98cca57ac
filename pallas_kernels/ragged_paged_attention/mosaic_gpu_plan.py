"""Host-side plan of the Mosaic GPU ragged paged attention kernel: its static parameters
(validated shapes, dtypes and knobs, shared-memory budget), the query-block schedule, and the
packing of each block's (token, head) rows into the tiles the kernel copies (and back)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from .kv_quant import is_int8

ROWS = 64  # wgmma's M: the (token, head) rows of one warpgroup's tile
_MIN_BLOCK_KV = 64  # K/V tiles are converted in registers in wgmma's layout (64-row multiples)
_MAX_BLOCK_KV = 256  # wgmma's largest N (S = Q K^T is 64 x block_kv)
# Hopper's shared memory per block (opt-in maximum, 227 KiB) less Mosaic GPU's reduction
# scratch and the barriers.
SMEM_BYTES = 227 * 1024 - 4 * 1024
_QUERY_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's static parameters."""

    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    interpret: bool
    group: int
    block_q: int
    rows: int  # packed query rows per (block, kv head): block_q * group rounded up to 8
    block_kv: int
    block_size: int
    num_blocks: int
    max_pages: int
    head_dim: int
    num_splits: int
    num_stages: int
    compute_dtype: jnp.dtype  # the wgmma operands' dtype
    q_parts: int  # bfloat16 parts of a float32 query (1: the queries' own dtype)
    kv_parts: int  # parts of a converted K/V tile
    direct: bool  # the cache holds the operands' dtype: TMA copies straight into operands
    cache_dtype: jnp.dtype
    out_dtype: jnp.dtype

    @property
    def pages_per_tile(self) -> int:
        return self.block_kv // self.block_size


def split_parts(x: jax.Array, parts: int, dtype) -> list[jax.Array]:
    """float32 x as `parts` values of `dtype` whose sum is x (to 8 bits a part for bfloat16)."""
    out = []
    for _ in range(parts - 1):
        hi = x.astype(dtype)
        out.append(hi)
        x = x - hi.astype(jnp.float32)
    out.append(x.astype(dtype))
    return out


def product_pairs(a: int, b: int) -> list[tuple[int, int]]:
    """The products of parts a_i b_j that reach float32 precision (i + j <= 2)."""
    return [(i, j) for i in range(a) for j in range(b) if i + j <= 2]


def smem_bytes(c: Config) -> int:
    """Shared memory the kernel allocates (its larger scope: the KV loop or the output)."""
    cd = jnp.dtype(c.compute_dtype).itemsize
    kv_item = cd if c.direct else jnp.dtype(c.cache_dtype).itemsize
    loop = c.q_parts * ROWS * c.head_dim * cd
    loop += 2 * c.num_stages * c.block_kv * c.head_dim * kv_item
    loop += 0 if c.direct else c.kv_parts * c.block_kv * c.head_dim * cd
    loop += c.q_parts * ROWS * c.block_kv * cd
    out = ROWS * c.head_dim * jnp.dtype(c.out_dtype).itemsize
    out += 0 if c.num_splits == 1 else 2 * ROWS * 4
    return max(loop, out)


def pack_queries(q, qsl, blk_req, blk_row, q_lens, c: Config, num_kv_heads: int):
    """[q_parts, num_q_blocks, Hkv, rows, D]: block g's rows for kv head h, row m being
    (token m // group, head h * group + m % group); zero past the block's tokens."""
    m = jnp.arange(c.rows, dtype=jnp.int32)
    tok = m // c.group
    num_rows = jnp.clip(q_lens[blk_req] - blk_row, 0, c.block_q)
    ok = tok[None, :] < num_rows[:, None]
    token = jnp.where(ok, qsl[blk_req][:, None] + blk_row[:, None] + tok[None, :], 0)
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None] * c.group + (m % c.group)[None, :]
    x = q[token[:, None, :], heads[None, :, :]]
    x = jnp.where(ok[:, None, :, None], x, 0)
    if c.q_parts == 1:
        return x[None].astype(c.compute_dtype)
    return jnp.stack(split_parts(x.astype(jnp.float32), c.q_parts, c.compute_dtype))


def packed_rows(qsl, block_start, c: Config, req, num_q_blocks: int, num_q_heads: int):
    """Where each (token, query head) sits in the packed rows: [T, Hq] indices of (block, kv
    head, row) for `req`, the tokens' requests; tokens past the last request get some in-range
    row (the caller masks them)."""
    local = jnp.arange(req.shape[0], dtype=jnp.int32) - qsl[req]
    g = jnp.clip(block_start[req] + local // c.block_q, 0, num_q_blocks - 1)
    h = jnp.arange(num_q_heads, dtype=jnp.int32)
    m = (local % c.block_q)[:, None] * c.group + (h % c.group)[None, :]
    return g[:, None], (h // c.group)[None, :], jnp.clip(m, 0, c.rows - 1)


def default_knobs(
    num_tokens: int, num_reqs: int, num_q_heads: int, num_kv_heads: int, block_size: int
) -> dict[str, int]:
    """Block sizes picked from static shapes: decode-like buckets (T <= R) get flash-decoding."""
    group = num_q_heads // num_kv_heads
    decode_like = num_tokens <= num_reqs
    block_q = 1 if decode_like else max(1, ROWS // group)
    splits = min(16, max(1, 256 // (num_reqs * num_kv_heads))) if decode_like else 1
    block_kv = math.lcm(_MIN_BLOCK_KV, block_size)
    return dict(block_q=block_q, block_kv=block_kv, num_kv_splits=splits)


def make_config(q, kv_cache, block_tables, **knobs) -> Config:
    """Validate shapes, dtypes and knobs; the kernel's static parameters."""
    if q.ndim != 3 or kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"q must be [T, Hq, D] and kv_cache [2, num_blocks, block_size, Hkv, row], got "
            f"{q.shape} and {kv_cache.shape}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, row = kv_cache.shape
    num_reqs = block_tables.shape[0]
    if is_int8(kv_cache.dtype):
        raise NotImplementedError(
            "int8 KV caches are not supported by the Mosaic GPU kernel: a cached row is "
            "head_dim + 4 bytes (codes, then the float32 scale), which breaks TMA's 16-byte "
            "stride and box alignment; use ragged_paged_attention_gpu (Triton) for int8"
        )
    if jnp.dtype(q.dtype) not in map(jnp.dtype, _QUERY_DTYPES):
        raise NotImplementedError(f"query dtype {q.dtype}: allowed float32, bfloat16, float16")
    if jnp.dtype(kv_cache.dtype) not in map(jnp.dtype, _CACHE_DTYPES):
        raise NotImplementedError(
            f"KV cache dtype {kv_cache.dtype}: allowed float32, bfloat16, float16, "
            "float8_e4m3fn, float8_e5m2 (int8: the Triton kernel)"
        )
    if row != head_dim:
        raise ValueError(f"kv_cache rows are {row} wide, q's head_dim is {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of {num_kv_heads=}")
    group = num_q_heads // num_kv_heads
    if group > ROWS:
        raise NotImplementedError(f"{group} query heads per kv head: at most {ROWS}")
    if head_dim % 16 or not 16 <= head_dim <= 256:
        raise NotImplementedError(f"head_dim={head_dim}: must be a multiple of 16 in [16, 256]")
    if block_size % 8:
        raise NotImplementedError(
            f"block_size={block_size}: pages are copied into 8-row shared-memory tiles, so the "
            "page size must be a multiple of 8"
        )
    defaults = default_knobs(num_tokens, num_reqs, num_q_heads, num_kv_heads, block_size)
    block_q = knobs["block_q"] or defaults["block_q"]
    block_kv = knobs["block_kv"] or defaults["block_kv"]
    num_splits = knobs["num_kv_splits"] or defaults["num_kv_splits"]
    if not 1 <= block_q * group <= ROWS:
        raise ValueError(
            f"block_q={block_q}: block_q * {group} query heads per kv head must be in [1, {ROWS}]"
        )
    if block_kv % _MIN_BLOCK_KV or block_kv % block_size or block_kv > _MAX_BLOCK_KV:
        raise ValueError(
            f"block_kv={block_kv}: must be a multiple of {_MIN_BLOCK_KV} and of block_size "
            f"({block_size}), at most {_MAX_BLOCK_KV}"
        )
    if num_splits < 1:
        raise ValueError(f"num_kv_splits={num_splits}: must be >= 1")
    q_f32 = jnp.dtype(q.dtype) == jnp.float32
    compute_dtype = jnp.dtype(jnp.bfloat16 if q_f32 else q.dtype)
    cache_dtype = jnp.dtype(kv_cache.dtype)
    exact_in_bf16 = cache_dtype.itemsize == 1 or cache_dtype == jnp.bfloat16
    c = Config(
        sm_scale=float(knobs["sm_scale"]),
        sliding_window=knobs["sliding_window"],
        soft_cap=knobs["soft_cap"],
        interpret=bool(knobs["interpret"]),
        group=group,
        block_q=block_q,
        rows=-(-block_q * group // 8) * 8,
        block_kv=block_kv,
        block_size=block_size,
        num_blocks=num_blocks,
        max_pages=block_tables.shape[1],
        head_dim=head_dim,
        num_splits=num_splits,
        num_stages=knobs["num_stages"] or 2,
        compute_dtype=compute_dtype,
        q_parts=3 if q_f32 else 1,
        kv_parts=3 if q_f32 and not exact_in_bf16 else 1,
        direct=cache_dtype == compute_dtype,
        cache_dtype=cache_dtype,
        out_dtype=jnp.dtype(q.dtype if num_splits == 1 else jnp.float32),
    )
    if knobs["num_stages"] is None and smem_bytes(c) > SMEM_BYTES:
        c = dataclasses.replace(c, num_stages=1)  # float32 caches: no room for two
    if c.num_stages < 1 or smem_bytes(c) > SMEM_BYTES:
        raise ValueError(
            f"num_stages={c.num_stages} with block_kv={block_kv}, head_dim={head_dim}, "
            f"{q.dtype} queries and a {cache_dtype} cache needs {smem_bytes(c)} bytes of shared "
            f"memory; the kernel has {SMEM_BYTES}: lower block_kv or num_stages"
        )
    return c
