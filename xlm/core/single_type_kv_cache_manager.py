"""One KV cache group's block tables: prefix lookup, allocation, window dropping, freeing.

With a sliding window (every layer of the group attends to at most `window` past tokens),
blocks whose tokens all fell out of the window are freed while the request runs and
replaced by the null block in its table, so a request holds at most
ceil(window / block_size) + 1 blocks past its prefill (plus the blocks of one step's new
tokens). Freed full blocks stay in the prefix cache until reused, like any freed block.
"""

from __future__ import annotations

from xlm.core.block_pool import BlockPool, KVCacheBlock
from xlm.core.kv_cache_utils import BlockHash, update_block_hashes
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


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group over a (shared) BlockPool."""

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        enable_caching: bool,
        sliding_window: int | None,
        group_id: int | None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} is invalid: must be >= 1 or None")
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # One of several groups: its cached blocks are keyed (group_id, hash), since the same
        # tokens give other K/V in other layers.
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Sliding window: how many leading blocks of each request were freed (now null).
        self.num_dropped_block: dict[str, int] = {}

    def cache_keys(self, hashes: list[BlockHash]) -> list[BlockHash] | GroupKeys:
        """This group's prefix-cache (and host tier) keys of a request's block hashes."""
        return hashes if self.group_id is None else GroupKeys(self.group_id, hashes)

    def find_cached_prefix(self, hashes: list[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """The longest run of cached blocks from the first, at most max_blocks."""
        get = self.block_pool.cached_block_hash_to_block.get
        keys = self.cache_keys(hashes)
        blocks = []
        for i in range(max_blocks):
            block = get(keys[i])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def find_cached_blocks(self, hashes: list[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """This group's longest usable hit of at most max_blocks blocks.

        Full attention needs every block of the prefix; a window needs only the blocks the
        next query (at the hit's end) can see, the ones before it come back as null.
        """
        if self.sliding_window is None:
            return self.find_cached_prefix(hashes, max_blocks)
        get = self.block_pool.cached_block_hash_to_block.get
        keys = self.cache_keys(hashes)
        k = max_blocks
        while k > 0:
            first = self.first_block_in_window(k * self.block_size)
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

    def fits_without_change(self, request_id: str, num_computed: int, num_total: int) -> bool:
        """Whether a running request's step needs no new, newly full or dropped block."""
        bs = self.block_size
        return (
            num_total <= len(self.req_to_blocks[request_id]) * bs
            and (not self.enable_caching or num_total // bs <= self.num_cached_block[request_id])
            and self.first_block_in_window(num_computed) <= self.num_dropped_block[request_id]
        )

    def num_new_blocks(self, request_id: str, num_total: int, num_hit: int) -> int:
        """Blocks to take from the pool for num_total tokens, beyond those held and hit."""
        num_held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, -(-num_total // self.block_size) - num_held - num_hit)

    def commit_slots(
        self,
        request: Request,
        num_computed: int,
        num_total: int,
        hit_blocks: list[KVCacheBlock] | None,
    ) -> list[int]:
        """Take the hit blocks and enough new ones for num_total tokens (capacity checked).

        Blocks that become full with the scheduled tokens are entered in the prefix cache
        at once, so a request scheduled later in the same step can share them: the runner
        writes each layer's new K/V before any attention reads it.
        """
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
            self.drop_out_of_window(request_id, num_computed)
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
                pool.cache_full_blocks(
                    req_blocks, self.cache_keys(hashes), num_cached, num_full, request, bs
                )
                self.num_cached_block[request_id] = num_full
        return new_ids

    def first_block_in_window(self, num_computed: int) -> int:
        """Index of the first block the next query (at position num_computed) can see."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def drop_out_of_window(self, request_id: str, num_computed: int) -> None:
        """Free the leading blocks no query from position num_computed on can attend to.

        The model runner keeps their stale ids in its table; attention masks every key
        outside the window by position, so whatever a reused block holds is never read.
        """
        req_blocks = self.req_to_blocks[request_id]
        first = min(self.first_block_in_window(num_computed), len(req_blocks))
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
