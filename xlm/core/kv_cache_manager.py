"""Which KV cache blocks each request holds: prefix-cache lookup, allocation, freeing.

With a sliding window (every attention layer of the model attends to at most `window`
past tokens), blocks whose tokens all fell out of the window are freed while the request
runs and replaced by the null block in its table, so a request holds at most
ceil(window / block_size) + 1 blocks past its prefill (plus the blocks of one step's new
tokens). Freed full blocks stay in the prefix cache until reused, like any freed block.

One manager serves one KV cache group; a model with layers of several windows has one per
group over a shared BlockPool (xlm.core.hybrid_kv_cache_manager).
"""

from __future__ import annotations

from xlm.core.block_pool import BlockPool, KVCacheBlock
from xlm.core.kv_cache_utils import BlockHash, update_block_hashes
from xlm.core.kv_manager import KVManager
from xlm.core.request import Request


class GroupKeys:
    """Prefix-cache keys of one KV cache group: (group id, block hash) by block index."""

    __slots__ = ("group_id", "hashes")

    def __init__(self, group_id: int, hashes: list[BlockHash]) -> None:
        self.group_id = group_id
        self.hashes = hashes

    def __getitem__(self, i: int) -> tuple[int, BlockHash]:
        return (self.group_id, self.hashes[i])


def num_evictable(blocks: list[KVCacheBlock]) -> int:
    """Blocks of a hit that sit in the free queue (taking them shrinks what is free)."""
    return sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)


class KVCacheManager(KVManager):
    """Maps requests to block tables over one BlockPool, with prefix caching."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        block_pool: BlockPool | None = None,
        group_id: int | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} is invalid: must be >= 1 or None")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = (
            BlockPool(num_blocks, enable_caching) if block_pool is None else block_pool
        )
        # One of several groups: its cached blocks are keyed (group_id, hash), since the same
        # tokens give other K/V in other layers.
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Sliding window: how many leading blocks of each request were freed (now null).
        self.num_dropped_block: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up, once per admission
        self.prefix_cache_hits = 0  # of which found cached

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.block_pool.get_usage()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request may hold (all but the null block)."""
        return self.block_pool.num_blocks - 1

    def num_blocks_to_fit(self, num_tokens: int) -> int:
        """Blocks a request of num_tokens needs at most, alone."""
        return -(-num_tokens // self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever fit, alone, in the whole pool."""
        return -(-num_tokens // self.block_size) <= self.num_usable_blocks

    @property
    def max_request_tokens(self) -> int:
        """The longest request the whole pool holds."""
        return self.num_usable_blocks * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as blocks and a token count.

        Never the whole sequence: its last token is always recomputed to produce logits.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = update_block_hashes(request, bs, max_blocks)
        get = self.block_pool.cached_block_hash_to_block.get
        blocks = []
        for i in range(max_blocks):
            block = get(hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Give the request slots for num_new_tokens more tokens; None if blocks run out.

        new_computed_blocks / num_new_computed_tokens are a prefix-cache hit from
        get_computed_blocks (admission only). Returns the ids of newly allocated blocks.
        Blocks that become full with the scheduled tokens are entered in the prefix cache
        at once, so a request scheduled later in the same step can share them: the runner
        writes each layer's new K/V before any attention reads it.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} is invalid: must be > 0")
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        bs = self.block_size
        if req_blocks is not None and not new_computed_blocks:
            # Fast path (most decode steps): the tokens fit, no block becomes full and none
            # leaves the window.
            num_computed = request.num_computed_tokens + num_new_computed_tokens
            num_total = num_computed + num_new_tokens
            if (
                num_total <= len(req_blocks) * bs
                and (
                    not self.enable_caching or num_total // bs <= self.num_cached_block[request_id]
                )
                and self._first_block_in_window(num_computed) <= self.num_dropped_block[request_id]
            ):
                return []
            self._drop_out_of_window(request_id, req_blocks, num_computed)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        num_hit = len(new_computed_blocks) if new_computed_blocks else 0
        num_held = 0 if req_blocks is None else len(req_blocks)
        num_new_blocks = -(-num_total // bs) - num_held - num_hit
        if num_new_blocks > 0 or num_hit:
            # Hit blocks sitting in the free queue stop being allocatable once touched.
            num_evictable_hits = num_evictable(new_computed_blocks) if num_hit else 0
            free = self.block_pool.free_block_queue.num_free_blocks
            if num_new_blocks > free - num_evictable_hits:
                return None
        if req_blocks is None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        return self.commit_slots(request, num_computed, num_total, new_computed_blocks)

    def fits_without_change(self, request_id: str, num_computed: int, num_total: int) -> bool:
        """Whether a running request's step needs no new, newly full or dropped block."""
        bs = self.block_size
        return (
            num_total <= len(self.req_to_blocks[request_id]) * bs
            and (not self.enable_caching or num_total // bs <= self.num_cached_block[request_id])
            and self._first_block_in_window(num_computed) <= self.num_dropped_block[request_id]
        )

    def commit_slots(
        self,
        request: Request,
        num_computed: int,
        num_total: int,
        hit_blocks: list[KVCacheBlock] | None,
    ) -> list[int]:
        """Take the hit blocks and enough new ones for num_total tokens (capacity checked)."""
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
            self.num_dropped_block[request_id] = 0
        pool = self.block_pool
        bs = self.block_size
        if hit_blocks:
            pool.touch([b for b in hit_blocks if not b.is_null])
            req_blocks.extend(hit_blocks)
            # Hits are cached already (nulls: a windowed group's blocks before its window).
            self.num_cached_block[request_id] = len(req_blocks)
            self._drop_out_of_window(request_id, req_blocks, num_computed)
        num_new_blocks = -(-num_total // bs) - len(req_blocks)
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            new_ids = [b.block_id for b in new_blocks]
        else:
            new_ids = []
        if self.enable_caching:
            # Only blocks of known tokens are hashed: with async scheduling the last
            # scheduled token may still be in flight (hashed at the next allocation).
            num_full = min(num_total, len(request.all_token_ids)) // bs
            num_cached = self.num_cached_block[request_id]
            if num_full > num_cached:
                hashes = update_block_hashes(request, bs, num_full)
                keys = hashes if self.group_id is None else GroupKeys(self.group_id, hashes)
                pool.cache_full_blocks(req_blocks, keys, num_cached, num_full)
                self.num_cached_block[request_id] = num_full
        return new_ids

    def find_cached_blocks(self, hashes: list[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """This group's longest usable hit of at most max_blocks blocks.

        Full attention needs every block of the prefix; a window needs only the blocks the
        next query (at the hit's end) can see, the ones before it come back as null.
        """
        get = self.block_pool.cached_block_hash_to_block.get
        keys = hashes if self.group_id is None else GroupKeys(self.group_id, hashes)
        if self.sliding_window is None:
            blocks = []
            for i in range(max_blocks):
                block = get(keys[i])
                if block is None:
                    break
                blocks.append(block)
            return blocks
        k = max_blocks
        while k > 0:
            first = self._first_block_in_window(k * self.block_size)
            tail = []
            for i in range(k - 1, first - 1, -1):
                block = get(keys[i])
                if block is None:
                    break
                tail.append(block)
            else:
                tail.reverse()
                return [self.block_pool.null_block] * first + tail
            k = i  # block i is missing: every longer hit would need it
        return []

    def _first_block_in_window(self, num_computed: int) -> int:
        """Index of the first block the next query (at position num_computed) can see."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _drop_out_of_window(
        self, request_id: str, req_blocks: list[KVCacheBlock], num_computed: int
    ) -> None:
        """Free the leading blocks no query from position num_computed on can attend to.

        The model runner keeps their stale ids in its table; attention masks every key
        outside the window by position, so whatever a reused block holds is never read.
        """
        first = min(self._first_block_in_window(num_computed), len(req_blocks))
        dropped = self.num_dropped_block[request_id]
        if first <= dropped:
            return
        null = self.block_pool.null_block
        out = [b for b in req_blocks[dropped:first] if not b.is_null]
        req_blocks[dropped:first] = [null] * (first - dropped)
        self.num_dropped_block[request_id] = first
        self.block_pool.free_blocks(out)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (null placeholders of dropped blocks not counted)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so shared prefixes are evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        self.num_dropped_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()
