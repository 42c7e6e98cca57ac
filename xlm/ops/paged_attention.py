"""Attention over a paged KV cache for a ragged batch; this op owns the cache layout.

Layout (shared with pallas_kernels.ragged_paged_attention): one array per layer of shape
(2, num_blocks, block_size, num_kv_heads, row), [0] keys and [1] values, row = head_dim
(head_dim + 4 for an int8 cache: each row's float32 scale rides after its codes, see
pallas_kernels.ragged_paged_attention.kv_quant). Block 0 is the null block: padding tokens
write there and no request reads it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import dequantize, kv_cache_shape, write_kv
from xlm.distributed.mesh import TP_AXIS, tp_mesh
from xlm.logger import init_logger
from xlm.ops.cpu_kernels import PAGED_ATTENTION_CACHE_DTYPES
from xlm.ops.cpu_kernels import available as cpu_kernels_available
from xlm.ops.cpu_kernels import paged_attention as paged_attention_cpu
from xlm.ops.cpu_kernels import start_build as start_cpu_kernels_build
from xlm.ops.custom_op import CustomOp

logger = init_logger(__name__)

__all__ = [
    "KV_CACHE_SHARDING",
    "AttentionMetadata",
    "PagedAttention",
    "kv_cache_shape",
    "ragged_paged_attention",
    "write_kv",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """The ragged batch of one step, as device arrays (all int32).

    T tokens (padded), R requests (padded). Request r owns query rows
    query_start_loc[r]:query_start_loc[r+1]; its context (cached + new tokens) has
    seq_lens[r] tokens whose pages are block_tables[r]. Padded requests have zero rows.
    A model with G > 1 KV cache groups (xlm.core.kv_cache_groups) has one slot mapping
    and one block table per group, stacked first: [G, T] and [G, R, max_blocks_per_req].
    """

    positions: jax.Array  # [T]; M-RoPE models (Qwen2-VL): [3, T], one row per stream
    slot_mapping: jax.Array  # [T] block_id * block_size + offset; padding -> null block
    query_start_loc: jax.Array  # [R + 1]
    seq_lens: jax.Array  # [R]
    block_tables: jax.Array  # [R, max_blocks_per_req]
    num_seqs: jax.Array  # [1] number of real requests

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV cache group `group` reads (itself with one group)."""
        if self.block_tables.ndim == 2:
            return self
        return dataclasses.replace(
            self, slot_mapping=self.slot_mapping[group], block_tables=self.block_tables[group]
        )


# Logical sharding of a layer's cache: over KV heads on the tensor-parallel axis.
KV_CACHE_SHARDING: tuple[str | None, ...] = (None, None, None, "model", None)
# The TPU kernel's pages are stored with heads and in-block positions merged, (2,
# num_blocks, num_kv_heads * block_size, head_dim), and viewed as the kernel's (2,
# num_blocks, num_kv_heads, block_size, head_dim) per chip: a chip holding one KV head
# would otherwise store a size-1 axis whose TPU layout is not the kernel's, and XLA copied
# the whole cache around every layer's write (found by `xlm plan`, docs/tpu.md).
KV_CACHE_SHARDING_TPU: tuple[str | None, ...] = (None, None, "model", None)


# Shapes the CPU kernel accepts (cpu_kernels/paged_attention.cc: kMaxPage and
# kMaxGroupRows, checked in PagedAttentionImpl); larger ones take the jnp path.
CPU_KERNEL_MAX_BLOCK_SIZE = 256
CPU_KERNEL_MAX_QUERIES_PER_KV = 64

# Tokens of context per step of the attention loop.
_TILE_TOKENS = 64

# A gathered cache element costs about this many score/value multiply-adds on CPU (the
# gather is memory-bound, the einsums are not); only the ratio matters to the choice.
_GATHER_COST = 4


def num_query_chunks(num_tokens: int, num_reqs: int, chunk_size: int) -> int:
    """Upper bound on chunks when each request's queries are cut into `chunk_size` pieces."""
    # Every real request has >= 1 token, so sum(ceil(q_r / c)) <= (T + n * (c - 1)) / c.
    n = min(num_reqs, num_tokens)
    return max(1, (num_tokens + n * (chunk_size - 1)) // chunk_size)


def choose_query_chunk(
    num_tokens: int, num_reqs: int, context_len: int, num_heads: int, num_kv_heads: int
) -> int:
    """Static query-chunk size minimizing gather plus einsum work for these shapes.

    Chunk size 1 is per-token attention (V = T chunks): no wasted query rows, but every
    token gathers its request's whole context, which is ideal for decode (T == R) and
    ruinous for a long prefill. Larger chunks share one gathered context among the chunk's
    queries at the price of padded rows. The bound on the chunk count only depends on
    static shapes, so the choice is made at trace time.
    """
    best, best_cost = 1, None
    c = 1
    while True:
        v = num_query_chunks(num_tokens, num_reqs, c)
        cost = v * context_len * (2 * num_kv_heads * _GATHER_COST + 2 * c * num_heads)
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
        if c >= num_tokens:
            return best
        c *= 2


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """Each request's query rows cut into chunks of `size` rows: chunk v is rows
    [v * size, (v + 1) * size) of the chunked layout, all of one request."""

    size: int
    count: int
    start: jax.Array  # [R] the first chunk of each request
    req: jax.Array  # [V] the request of each chunk
    row_token: jax.Array  # [V, Q] the query token of each row (clipped for padding rows)
    row_pos: jax.Array  # [V, Q] each row's position in its request's context

    @classmethod
    def of(cls, metadata: AttentionMetadata, num_tokens: int, size: int) -> _Chunks:
        num_reqs = metadata.block_tables.shape[0]
        count = num_query_chunks(num_tokens, num_reqs, size)
        qsl = metadata.query_start_loc
        q_lens = qsl[1:] - qsl[:-1]  # [R]
        per_req = (q_lens + size - 1) // size
        end = jnp.cumsum(per_req)
        start = end - per_req
        ids = jnp.arange(count, dtype=jnp.int32)
        req = jnp.searchsorted(end, ids, side="right").astype(jnp.int32)
        req = jnp.minimum(req, num_reqs - 1)
        row_local = ((ids - start[req]) * size)[:, None] + jnp.arange(size, dtype=jnp.int32)
        row_token = jnp.clip(qsl[req][:, None] + row_local, 0, num_tokens - 1)
        # The new tokens are the last q_len ones of the context.
        row_pos = (metadata.seq_lens - q_lens)[req][:, None] + row_local
        return cls(size, count, start, req, row_token, row_pos)

    def token_rows(self, qsl: jax.Array, num_tokens: int) -> jax.Array:
        """[T] each token's row in the chunked layout."""
        token_ids = jnp.arange(num_tokens, dtype=jnp.int32)
        token_req = jnp.searchsorted(qsl, token_ids, side="right").astype(jnp.int32) - 1
        token_req = jnp.clip(token_req, 0, self.start.shape[0] - 1)
        local = token_ids - qsl[token_req]
        row = (self.start[token_req] + local // self.size) * self.size + local % self.size
        return jnp.clip(row, 0, self.count * self.size - 1)


def ragged_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    query_chunk: int | None = None,
) -> jax.Array:
    """Causal attention of each query over its request's paged context (cache already written).

    Each request's queries are cut into chunks of `query_chunk` rows; chunk v attends to
    the pages of its request only ([V, Q] queries x [V, C] keys), so the work is
    V * Q * C instead of T * R * C. Padding rows compute finite garbage, never read.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_reqs, max_blocks = metadata.block_tables.shape
    if query_chunk is None:
        query_chunk = choose_query_chunk(
            num_tokens, num_reqs, max_blocks * block_size, num_heads, num_kv_heads
        )
    chunks = _Chunks.of(metadata, num_tokens, query_chunk)
    # Heads-major layouts make both einsums plain batched matmuls over (chunk, kv head);
    # on CPU the other output layouts cost a transpose as large as the matmul.
    queries = q[chunks.row_token].reshape(
        chunks.count, query_chunk, num_kv_heads, num_heads // num_kv_heads, head_dim
    )
    queries = queries * jnp.asarray(scale, q.dtype)
    out = _attend_tiles(
        queries, kv_cache, metadata, chunks, sliding_window, logits_soft_cap
    )  # [V, K, G, Q, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(chunks.count * query_chunk, num_heads, head_dim)
    return out[chunks.token_rows(metadata.query_start_loc, num_tokens)].astype(q.dtype)


def _attend_tiles(
    queries: jax.Array,
    kv_cache: jax.Array,
    metadata: AttentionMetadata,
    chunks: _Chunks,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> jax.Array:
    """Scaled queries [V, Q, K, G, D] over their chunks' pages -> float32 [V, K, G, Q, D]."""
    num_chunks, qc, num_kv_heads, group, head_dim = queries.shape
    dtype = queries.dtype
    block_size = kv_cache.shape[2]
    num_reqs, max_blocks = metadata.block_tables.shape
    row_pos = chunks.row_pos
    # Pages are visited in tiles with an online softmax; the loop runs only over the tiles
    # the step's longest context needs, so work follows real context lengths, not the
    # block-table width (sized for max_model_len), with one small loop body to compile.
    tile_pages = max(1, min(max_blocks, _TILE_TOKENS // block_size))
    num_tiles_max = -(-max_blocks // tile_pages)
    pages = metadata.block_tables[chunks.req]  # [V, B]
    pages = jnp.pad(pages, ((0, 0), (0, num_tiles_max * tile_pages - max_blocks)))
    tile_len = tile_pages * block_size
    longest = jnp.max(jnp.where(jnp.arange(num_reqs) < metadata.num_seqs[0], metadata.seq_lens, 0))
    num_tiles = jnp.minimum((longest + tile_len - 1) // tile_len, num_tiles_max)
    # float32 accumulation; asked for only when inputs are narrower (on CPU, asking for it
    # with float32 inputs picked a slower dot).
    acc_kw = {} if dtype == jnp.float32 else {"preferred_element_type": jnp.float32}

    def tile(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, denom, acc = carry
        tile_pages_ids = jax.lax.dynamic_slice_in_dim(pages, i * tile_pages, tile_pages, axis=1)
        # An fp8 or int8 cache is widened to the queries' dtype as it is read.
        keys = dequantize(kv_cache[0][tile_pages_ids], dtype)
        keys = keys.reshape(num_chunks, tile_len, num_kv_heads, head_dim)
        values = dequantize(kv_cache[1][tile_pages_ids], dtype)
        values = values.reshape(num_chunks, tile_len, num_kv_heads, head_dim)
        scores = jnp.einsum("vqkgd,vckd->vkgqc", queries, keys, **acc_kw)
        scores = scores.astype(jnp.float32)
        if logits_soft_cap is not None:
            scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
        key_pos = i * tile_len + jnp.arange(tile_len, dtype=jnp.int32)
        mask = key_pos[None, None, :] <= row_pos[:, :, None]  # [V, Q, C]
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > row_pos[:, :, None] - sliding_window
        mask = mask[:, None, None]
        scores = jnp.where(mask, scores, -1e30)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        denom = denom * correction + jnp.sum(p, axis=-1)
        pv = jnp.einsum("vkgqc,vckd->vkgqd", p.astype(dtype), values, **acc_kw)
        return m_new, denom, acc * correction[..., None] + pv.astype(jnp.float32)

    stats_shape = (num_chunks, num_kv_heads, group, qc)
    init = (
        jnp.full(stats_shape, -1e30, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros((*stats_shape, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_tiles, tile, init)
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # padding rows saw no key: zeros


@functools.cache
def _cpu_kernel_fits(block_size: int, queries_per_kv: int) -> bool:
    """Whether the CPU kernel takes these shapes; says once at info when it does not."""
    fits = (
        block_size <= CPU_KERNEL_MAX_BLOCK_SIZE and queries_per_kv <= CPU_KERNEL_MAX_QUERIES_PER_KV
    )
    if not fits:
        logger.info(
            "CPU attention takes the jnp path: the kernel needs block_size <= %d and <= %d "
            "query heads per KV head (got %d and %d)",
            CPU_KERNEL_MAX_BLOCK_SIZE,
            CPU_KERNEL_MAX_QUERIES_PER_KV,
            block_size,
            queries_per_kv,
        )
    return fits


def _kernel_path(select: Callable) -> Callable:
    """A forward method running the (kernel, write) pair `select(op, q, kv_cache)` picks
    for its inputs (PagedAttention._run_kernel), or the jnp path where it picks None."""

    def forward(
        self: PagedAttention,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        kernel = select(self, q, kv_cache)
        if kernel is None:
            return self.forward_native(q, k, v, kv_cache, metadata)
        return self._run_kernel(*kernel, q, k, v, kv_cache, metadata)

    forward.__doc__ = select.__doc__
    return forward


@CustomOp.register("paged_attention")
class PagedAttention(CustomOp):
    """Writes a step's new K/V into the paged cache and attends causally over each context."""

    # Attention uses its platform kernel wherever one exists.
    default_enabled = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # The KV cache group whose block table this layer reads (models with several).
        self.kv_group = 0
        if self._forward_name == "forward_cpu":
            # Built in the background from now; the loader waits for it before it returns
            # the model, so a saved program that calls the kernel loads without tracing.
            start_cpu_kernels_build()

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, dtype=jnp.float32
    ) -> tuple[int, ...]:
        """One layer's `dtype` cache shape in the layout of the path this instance
        dispatches to."""
        if self._forward_name == "forward_tpu":
            from pallas_kernels.ragged_paged_attention import kv_cache_shape_tpu

            two, blocks, heads, size, row = kv_cache_shape_tpu(
                num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype
            )
            return (two, blocks, heads * size, row)
        return kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype)

    def kv_cache_sharding(self) -> tuple[str | None, ...]:
        """Mesh axis names of the cache's dimensions (KV heads over the `model` axis)."""
        if self._forward_name == "forward_tpu":
            return KV_CACHE_SHARDING_TPU
        return KV_CACHE_SHARDING

    def forward_native(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        """q [T, Hq, D], k/v [T, Hkv, D] -> (out [T, Hq, D], updated kv_cache)."""
        metadata = metadata.for_group(self.kv_group)
        kv_cache = write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = ragged_paged_attention(
            q,
            kv_cache,
            metadata,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )
        return out, kv_cache

    def _run_kernel(
        self, kernel, write, q, k, v, kv_cache, metadata: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        """Write K/V and run a Pallas kernel; per head shard under a tensor-parallel mesh.

        XLA cannot partition a Pallas call, so under a mesh that splits `model` each
        device runs the kernel on its own query and KV heads (`shard_map`): attention
        needs no collective since every device holds the KV heads its query heads use.
        """
        metadata = metadata.for_group(self.kv_group)
        mesh = tp_mesh()
        if mesh is None:
            return self._run_kernel_local(kernel, write, q, k, v, kv_cache, metadata)
        from jax.sharding import PartitionSpec as P

        heads = P(None, TP_AXIS, None)
        cache = P(*self.kv_cache_sharding())

        def local(q, k, v, kv_cache, metadata):
            return self._run_kernel_local(kernel, write, q, k, v, kv_cache, metadata)

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(heads, heads, heads, cache, P()),
            out_specs=(heads, cache),
            check_vma=False,
        )(q, k, v, kv_cache, metadata)

    def _run_kernel_local(
        self, kernel, write, q, k, v, kv_cache, metadata: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        kv_cache = write(kv_cache, k, v, metadata.slot_mapping)
        out = kernel(
            q,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.num_seqs,
            sm_scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap,
        )
        return out, kv_cache

    def _cpu_kernel(self, q: jax.Array, kv_cache: jax.Array) -> tuple[Callable, Callable] | None:
        """The native CPU kernel (xlm.ops.cpu_kernels): one call per layer instead of
        XLA's tile loop of small instructions, reading float32 caches in place and
        bfloat16, fp8 and int8 ones widened as read. bfloat16 queries, shapes past the
        kernel's limits, or no kernel, take the jnp path."""
        if (
            q.dtype != jnp.float32
            or kv_cache.dtype not in PAGED_ATTENTION_CACHE_DTYPES
            or not cpu_kernels_available()
            or not _cpu_kernel_fits(kv_cache.shape[2], self.num_heads // self.num_kv_heads)
        ):
            return None
        return paged_attention_cpu, write_kv

    def _cuda_kernel(self, q: jax.Array, kv_cache: jax.Array) -> tuple[Callable, Callable]:
        """The Pallas Triton kernel over the shared layout."""
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu, write_kv

    def _tpu_kernel(self, q: jax.Array, kv_cache: jax.Array) -> tuple[Callable, Callable]:
        """The Pallas Mosaic kernel over its own (head-major pages) layout."""
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention_tpu, write_kv_tpu

        def pages(cache: jax.Array, local_kv_heads: int) -> jax.Array:
            """This chip's stored cache viewed in the kernel's layout."""
            two, blocks, rows, dim = cache.shape
            return cache.reshape(two, blocks, local_kv_heads, rows // local_kv_heads, dim)

        def write(cache, k, v, slot_mapping):
            return write_kv_tpu(pages(cache, k.shape[1]), k, v, slot_mapping).reshape(cache.shape)

        def kernel(q, cache, *args, **kwargs):
            local_kv_heads = q.shape[1] * self.num_kv_heads // self.num_heads
            return ragged_paged_attention_tpu(q, pages(cache, local_kv_heads), *args, **kwargs)

        return kernel, write

    forward_cpu = _kernel_path(_cpu_kernel)
    forward_cuda = _kernel_path(_cuda_kernel)
    forward_tpu = _kernel_path(_tpu_kernel)
