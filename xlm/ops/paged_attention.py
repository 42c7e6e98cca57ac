"""Attention over a paged KV cache for a ragged batch; this op owns the cache layout.

Layout (shared with pallas_kernels.ragged_paged_attention): one array per layer of shape
(2, num_blocks, block_size, num_kv_heads, head_dim), [0] keys and [1] values. Block 0 is
the null block: padding tokens write there and no request reads it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from xlm.ops.custom_op import CustomOp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """The ragged batch of one step, as device arrays (all int32).

    T tokens (padded), R requests (padded). Request r owns query rows
    query_start_loc[r]:query_start_loc[r+1]; its context (cached + new tokens) has
    seq_lens[r] tokens whose pages are block_tables[r]. Padded requests have zero rows.
    """

    positions: jax.Array  # [T]
    slot_mapping: jax.Array  # [T] block_id * block_size + offset; padding -> null block
    query_start_loc: jax.Array  # [R + 1]
    seq_lens: jax.Array  # [R]
    block_tables: jax.Array  # [R, max_blocks_per_req]
    num_seqs: jax.Array  # [1] number of real requests


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of one layer's KV cache."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new keys/values [T, Hkv, D] into their slots of the cache."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.reshape(2, num_blocks * block_size, num_kv_heads, head_dim)
    kv = jnp.stack([k, v]).astype(kv_cache.dtype)
    flat = flat.at[:, slot_mapping].set(kv, mode="drop", unique_indices=False)
    return flat.reshape(kv_cache.shape)


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

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward_native(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        """q [T, Hq, D], k/v [T, Hkv, D] -> (out [T, Hq, D], updated kv_cache)."""
        raise NotImplementedError("native paged attention lands with the models issue")
