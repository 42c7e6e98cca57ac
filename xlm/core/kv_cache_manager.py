"""Which KV cache blocks each request holds, over one or several KV cache groups.

One SingleTypeKVCacheManager per group (xlm.core.kv_cache_groups) over one shared
BlockPool: each group keeps its own block table per request; a windowed group frees the
blocks that fell out of its window, a full-attention group keeps them all. Allocation is
all-or-nothing over the groups; a prefix-cache hit is the longest prefix every group can
serve. Block ids go out as one list for one group, a tuple of lists for several; the
scheduler passes them through to the runner without looking inside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xlm.core.block_pool import BlockPool, KVCacheBlock
from xlm.core.host_kv_tier import HostKVTier
from xlm.core.kv_cache_groups import KVCacheGroupSpec, blocks_for_request
from xlm.core.kv_cache_utils import update_block_hashes
from xlm.core.kv_events import KVCacheEvent, KVEventRecorder
from xlm.core.request import Request
from xlm.core.single_type_kv_cache_manager import SingleTypeKVCacheManager, num_evictable

# A request's block ids: one list, or one sequence per KV cache group.
BlockIds = list[int] | tuple[Sequence[int], ...]


@dataclass(slots=True)
class HostHit:
    """A host KV tier hit of num_blocks blocks after a device hit: per group, the host slots
    it loads (in block order) and the first block it needs (past 0 for a window only)."""

    num_blocks: int
    slots: list[list[int]]
    first_needed: list[int]


class KVCacheManager:
    """Maps requests to block tables (one per KV cache group) over one BlockPool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        kv_cache_groups: list[KVCacheGroupSpec] | None = None,
        max_num_batched_tokens: int | None = None,
        num_host_blocks: int = 0,
        host_block_bytes: int = 0,
        kv_events: bool = False,
    ) -> None:
        """`sliding_window`: every layer's window when kv_cache_groups is None (one group);
        `num_host_blocks` of `host_block_bytes`: the host KV tier (0: off); `kv_events`:
        record the block events (take_events)."""
        if not kv_cache_groups:
            kv_cache_groups = [KVCacheGroupSpec(sliding_window, ())]
        self.specs = list(kv_cache_groups)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # The most tokens one step computes for a request (bounds a window's blocks).
        self.max_step_tokens = max_num_batched_tokens or max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        if num_host_blocks > 0:
            self.block_pool.host_tier = HostKVTier(num_host_blocks, host_block_bytes)
        if kv_events:
            self.block_pool.kv_events = KVEventRecorder()
        one = len(self.specs) == 1
        # One group's cached blocks are keyed by hash alone; several groups' by (group, hash).
        self.groups = [
            SingleTypeKVCacheManager(
                self.block_pool, block_size, enable_caching, spec.sliding_window, None if one else g
            )
            for g, spec in enumerate(self.specs)
        ]
        # The window of every layer (None: full attention, or several groups).
        self.sliding_window = self.specs[0].sliding_window if one else None
        self._no_hits: tuple[None, ...] = (None,) * len(self.groups)
        self._no_new_blocks: tuple[tuple[int, ...], ...] = ((),) * len(self.groups)
        # Groups of one window always hold the same number of (cached, dropped) blocks:
        # the decode fast path checks one group per window.
        first_of_window = {}
        for g in self.groups:
            first_of_window.setdefault(g.sliding_window, g)
        self._window_representatives = list(first_of_window.values())
        self.prefix_cache_queries = 0  # tokens looked up, once per admission
        self.prefix_cache_hits = 0  # of which found cached

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (all groups)."""
        return self.block_pool.get_usage()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks all groups together may hold (all but the null block)."""
        return self.block_pool.num_blocks - 1

    # One group is sized (and hit, in get_computed_blocks) as if it kept every block, window
    # or not; several groups bound a windowed group's blocks by its window.

    def num_blocks_to_fit(self, num_tokens: int) -> int:
        """Blocks a request of num_tokens needs at most, alone, over all groups."""
        if len(self.groups) == 1:
            return -(-num_tokens // self.block_size)
        return blocks_for_request(self.specs, num_tokens, self.block_size, self.max_step_tokens)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever fit, alone, in the whole pool."""
        return self.num_blocks_to_fit(num_tokens) <= self.num_usable_blocks

    @property
    def max_request_tokens(self) -> int:
        """The longest request the whole pool holds alone (several groups: <= max_model_len)."""
        if len(self.groups) == 1:
            return self.num_usable_blocks * self.block_size
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
    ) -> tuple[list[KVCacheBlock] | tuple[list[KVCacheBlock], ...], int]:
        """The longest cached prefix: (its blocks, or blocks per group, token count).

        Never the whole sequence: its last token is always recomputed to produce logits.
        ([], 0) on a miss.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = update_block_hashes(request, bs, max_blocks)
        groups = self.groups
        if len(groups) == 1:
            blocks = groups[0].find_cached_prefix(hashes, max_blocks)
            return blocks, len(blocks) * bs
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

    def find_host_blocks(self, request: Request, num_hit_tokens: int) -> HostHit | None:
        """The host KV tier's hit right after a device hit of num_hit_tokens
        (xlm.core.host_kv_tier): the longest run of blocks every group can load; None
        without a tier or a host hit. Never the last token's block.

        One group loads every block of the run (as its device hits keep every block). Of
        several groups, a windowed one loads only the blocks in its window at the run's end
        (those before stand as null blocks, as in its device hits; see extend_hit).
        """
        tier = self.block_pool.host_tier
        if tier is None or not self.enable_caching or request.skip_prefix_cache:
            return None
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        start = num_hit_tokens // bs
        if start >= max_blocks:
            return None
        hashes = update_block_hashes(request, bs, max_blocks)
        keys = [g.cache_keys(hashes) for g in self.groups]
        stop, agreed, g = max_blocks, 0, 0
        found: list[list[int]] = [[] for _ in self.groups]
        # Each group shortens the run to what it holds from its first needed block (a
        # missing block i rules out every run past i; a window needs earlier blocks of a
        # shorter run, so the group that shortened looks again); done when all agree in a row.
        while agreed < len(self.groups) and stop > start:
            lo = max(start, self._first_needed_block(g, stop))
            slots = tier.find(keys[g], lo, stop)
            if lo + len(slots) < stop:
                stop, agreed = lo + len(slots), 0
                continue
            else:
                agreed += 1
            found[g] = slots
            g = (g + 1) % len(self.groups)
        if stop <= start:
            return None
        firsts = [self._first_needed_block(g, stop) for g in range(len(found))]
        slots = [s[: stop - max(start, f)] for s, f in zip(found, firsts)]
        return HostHit(stop - start, slots, firsts)

    def _first_needed_block(self, g: int, stop: int) -> int:
        """The first block group g needs of a hit of `stop` blocks (0 but for a window of
        several groups)."""
        group = self.groups[g]
        if len(self.groups) == 1 or group.sliding_window is None:
            return 0
        return group.first_block_in_window(stop * self.block_size)

    def extend_hit(
        self, hit_blocks: list[KVCacheBlock] | tuple[list[KVCacheBlock], ...], host: HostHit
    ) -> list[KVCacheBlock] | tuple[list[KVCacheBlock], ...]:
        """A device hit extended to the end of the host hit: a windowed group's blocks out
        of its window there become null blocks (never read, never entered in the prefix
        cache), the device's and the host's alike; the loaded blocks are allocated after."""
        if not any(host.first_needed):
            return hit_blocks
        hits = hit_blocks or ([],) * len(self.groups)
        null = self.block_pool.null_block
        out = []
        for hit, first in zip(hits, host.first_needed, strict=True):
            kept = [null] * min(first, len(hit)) + list(hit[first:])
            out.append(kept + [null] * max(0, first - len(hit)))
        return tuple(out)

    def load_host_blocks(
        self, request: Request, num_hit_tokens: int, host: HostHit, new_block_ids: BlockIds
    ) -> None:
        """Have this step copy the host hit into the first new blocks allocated for it in
        each group (allocate_slots counted them as new tokens; they are computed by the copy)."""
        tier = self.block_pool.host_tier
        start = num_hit_tokens // self.block_size
        per_group = (new_block_ids,) if len(self.groups) == 1 else new_block_ids
        groups = zip(self.groups, host.slots, host.first_needed, per_group, strict=True)
        for g, slots, first_needed, ids in groups:
            keys = g.cache_keys(request.block_hashes)
            first = max(start, first_needed)
            tier.load(
                [keys[i] for i in range(first, first + len(slots))], slots, list(ids[: len(slots)])
            )
        tier.num_hit_tokens += host.num_blocks * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | tuple[list[KVCacheBlock], ...] | None = None,
    ) -> BlockIds | None:
        """Give the request slots for num_new_tokens more tokens; None if blocks run out.

        new_computed_blocks / num_new_computed_tokens are a prefix-cache hit from
        get_computed_blocks (admission only). Returns the ids of newly allocated blocks.
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
                # Fast path (most decode steps): no group needs a new, full or dropped block.
                return [] if len(groups) == 1 else self._no_new_blocks
            for g in groups:
                g.drop_out_of_window(request_id, num_computed)
        if not new_computed_blocks:
            hits = self._no_hits
        elif len(groups) == 1:
            hits = (new_computed_blocks,)
        else:
            hits = new_computed_blocks
        num_new_blocks = num_evictable_hits = 0
        for g, hit in zip(groups, hits):
            num_new_blocks += g.num_new_blocks(request_id, num_total, len(hit) if hit else 0)
            if hit:
                num_evictable_hits += num_evictable(hit)
        # Hit blocks sitting in the free queue stop being allocatable once touched.
        if num_new_blocks > self.block_pool.free_block_queue.num_free_blocks - num_evictable_hits:
            return None
        if is_new:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        if new_computed_blocks:
            # Every group takes its hits before any group allocates: a hit block waiting in
            # the free queue must not be handed out as another group's new block.
            for g, hit in zip(groups, hits):
                g.commit_slots(request, num_computed, num_computed, hit)
        new_ids = [g.commit_slots(request, num_computed, num_total, None) for g in groups]
        return self._block_ids(new_ids)

    def _block_ids(self, per_group: list[list[int]]) -> BlockIds:
        """One group's list as is; several groups' as a tuple (the runner tells them apart)."""
        return per_group[0] if len(per_group) == 1 else tuple(per_group)

    def num_held_blocks_per_group(self, request_id: str) -> list[int]:
        """Blocks the request holds now in each group (dropped ones not counted)."""
        return [g.num_held_blocks(request_id) for g in self.groups]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now, all groups together."""
        return sum(self.num_held_blocks_per_group(request_id))

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, tail first (shared prefixes last)."""
        for g in self.groups:
            g.free(request)

    def get_block_ids(self, request_id: str) -> BlockIds:
        """The request's block table (one per group for several groups)."""
        return self._block_ids([g.get_block_ids(request_id) for g in self.groups])

    def take_events(self) -> list[KVCacheEvent]:
        """The block events recorded since the last call ([] when not recorded)."""
        events = self.block_pool.kv_events
        return [] if events is None else events.take()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()
