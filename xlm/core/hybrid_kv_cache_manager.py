"""KV cache blocks of a model with several KV cache groups (layers of different windows).

One KVCacheManager per group (xlm.core.kv_cache_groups) over one shared BlockPool: each
group keeps its own block table per request; a windowed group frees the blocks that fell
out of its window, a full-attention group keeps them all. Block ids go out as one list per
group. Allocation is all-or-nothing over the groups; a prefix-cache hit is the longest
prefix every group can serve (full attention: all its blocks cached; a window: the blocks
the next query sees).
"""

from __future__ import annotations

from xlm.core.block_pool import BlockPool, KVCacheBlock
from xlm.core.kv_cache_groups import KVCacheGroupSpec, blocks_for_request
from xlm.core.kv_cache_manager import KVCacheManager, num_evictable
from xlm.core.kv_cache_utils import update_block_hashes
from xlm.core.kv_manager import KVManager
from xlm.core.request import Request

# One sequence of block ids per group.
GroupBlockIds = tuple[list[int] | tuple[int, ...], ...]


class HybridKVCacheManager(KVManager):
    """Block tables per KV cache group over one BlockPool, with prefix caching."""

    def __init__(
        self,
        groups: list[KVCacheGroupSpec],
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        if len(groups) < 2:
            raise ValueError(f"HybridKVCacheManager needs >= 2 KV cache groups, got {len(groups)}")
        self.specs = list(groups)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # The most tokens one step computes for a request (bounds a window's blocks).
        self.max_step_tokens = max_num_batched_tokens or max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.groups = [
            KVCacheManager(
                num_blocks,
                block_size,
                max_model_len,
                enable_caching,
                sliding_window=spec.sliding_window,
                block_pool=self.block_pool,
                group_id=g,
            )
            for g, spec in enumerate(groups)
        ]
        # No model-wide window: groups have their own.
        self.sliding_window = None
        self._no_hits: tuple[None, ...] = (None,) * len(groups)
        self._no_new_blocks: tuple[tuple[int, ...], ...] = ((),) * len(groups)
        # Groups of one window always hold the same number of (cached, dropped) blocks:
        # the decode fast path checks one group per window.
        first_of_window = {}
        for g in self.groups:
            first_of_window.setdefault(g.sliding_window, g)
        self._window_representatives = list(first_of_window.values())
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (all groups)."""
        return self.block_pool.get_usage()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks all groups together may hold (all but the null block)."""
        return self.block_pool.num_blocks - 1

    def num_blocks_to_fit(self, num_tokens: int) -> int:
        """Blocks a request of num_tokens needs at most, alone, over all groups."""
        return blocks_for_request(self.specs, num_tokens, self.block_size, self.max_step_tokens)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever fit, alone, in the whole pool."""
        return self.num_blocks_to_fit(num_tokens) <= self.num_usable_blocks

    @property
    def max_request_tokens(self) -> int:
        """The longest request (<= max_model_len) the whole pool holds alone."""
        lo, hi = 0, self.max_model_len  # can_fit is monotone in the length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.can_fit(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def get_computed_blocks(
        self, request: Request
    ) -> tuple[tuple[list[KVCacheBlock], ...] | list, int]:
        """The longest prefix cached for every group: (blocks per group, token count)."""
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = update_block_hashes(request, bs, max_blocks)
        groups = self.groups
        found: list[list[KVCacheBlock]] = [[] for _ in groups]
        k = max_blocks
        # Each group shortens the hit to what it can serve (a window's answer for a shorter
        # hit may differ); done when every group in a row accepted the same length.
        agreed, g = 0, 0
        while agreed < len(groups) and k > 0:
            blocks = groups[g].find_cached_blocks(hashes, k)
            agreed = 1 if len(blocks) < k else agreed + 1
            k = len(blocks)
            found[g] = blocks
            g = (g + 1) % len(groups)
        if k == 0:
            return [], 0
        return tuple(found), k * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: tuple[list[KVCacheBlock], ...] | None = None,
    ) -> GroupBlockIds | None:
        """Slots for num_new_tokens more tokens in every group; None if blocks run out.

        Returns the newly allocated block ids per group (read-only sequences).
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} is invalid: must be > 0")
        request_id = request.request_id
        groups = self.groups
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        is_new = request_id not in groups[0].req_to_blocks
        if not is_new and not new_computed_blocks:
            for g in self._window_representatives:
                if not g.fits_without_change(request_id, num_computed, num_total):
                    break
            else:
                return self._no_new_blocks  # fast path: most decode steps
            for g in groups:
                g._drop_out_of_window(request_id, g.req_to_blocks[request_id], num_computed)
        hits = new_computed_blocks or self._no_hits
        num_required = -(-num_total // self.block_size)
        num_new_blocks = num_evictable_hits = 0
        for g, hit in zip(groups, hits):
            num_held = len(g.req_to_blocks.get(request_id, ()))
            num_hit = len(hit) if hit else 0
            num_new_blocks += max(0, num_required - num_held - num_hit)
            if num_hit:
                num_evictable_hits += num_evictable(hit)
        free = self.block_pool.free_block_queue.num_free_blocks
        if num_new_blocks > free - num_evictable_hits:
            return None
        if is_new:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        if new_computed_blocks:
            # Every group takes its hits before any group allocates: a hit block waiting in
            # the free queue must not be handed out as another group's new block.
            for g, hit in zip(groups, hits):
                g.commit_slots(request, num_computed, num_computed, hit)
        return tuple(g.commit_slots(request, num_computed, num_total, None) for g in groups)

    def num_held_blocks_per_group(self, request_id: str) -> list[int]:
        """Blocks the request holds now in each group (dropped ones not counted)."""
        return [g.num_held_blocks(request_id) for g in self.groups]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now, all groups together."""
        return sum(self.num_held_blocks_per_group(request_id))

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group."""
        for g in self.groups:
            g.free(request)

    def get_block_ids(self, request_id: str) -> GroupBlockIds:
        """The request's block table per group."""
        return tuple(g.get_block_ids(request_id) for g in self.groups)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()


def make_kv_cache_manager(
    groups: list[KVCacheGroupSpec] | None,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    enable_caching: bool = True,
    sliding_window: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> KVManager:
    """One group (or none known): the single-table manager; several: the hybrid one."""
    if groups is not None and len(groups) > 1:
        return HybridKVCacheManager(
            groups, num_blocks, block_size, max_model_len, enable_caching, max_num_batched_tokens
        )
    return KVCacheManager(
        num_blocks, block_size, max_model_len, enable_caching, sliding_window=sliding_window
    )
