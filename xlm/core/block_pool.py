"""Every KV cache block: ref counts, an LRU free queue and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xlm.core.kv_cache_utils import BlockHash

if TYPE_CHECKING:
    from xlm.core.host_kv_tier import HostKVTier
    from xlm.core.kv_events import KVEventRecorder


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of block_size token slots in the paged KV cache."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is full and registered in the prefix cache (also while free).
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # Block 0: never handed out; the model runner points padding slots at it.
    is_null: bool = False

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and remove from the middle.

    Order is eviction order: the head is reused first. Freed blocks go to the tail, so the
    least recently used cached block is evicted first.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        nxt = block.next_free_block
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        self._link(self._tail.prev_free_block, block, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the head (reused first)."""
        self._link(self._head, block, self._head.next_free_block)

    def _link(self, prev: KVCacheBlock, block: KVCacheBlock, nxt: KVCacheBlock) -> None:
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = nxt
        nxt.prev_free_block = block
        self.num_free_blocks += 1


class BlockPool:
    """Owns every KVCacheBlock: allocation, freeing, and the hash map of cached full blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} is invalid: need >= 2 (block 0 is null)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # One block per hash: a second block computing the same content stays unregistered.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Optional listeners: the host KV tier saves what is evicted; the KV event
        # recorder publishes what is stored and removed (both set by the scheduler).
        self.host_tier: HostKVTier | None = None
        self.kv_events: KVEventRecorder | None = None

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached or not): what an allocation may take."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        usable = self.num_blocks - 1
        return (usable - self.free_block_queue.num_free_blocks) / usable

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take num_blocks from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.free_block_queue.num_free_blocks} free"
            )
        popleft = self.free_block_queue.popleft
        cached = self.cached_block_hash_to_block
        host_tier, events = self.host_tier, self.kv_events
        out = []
        for _ in range(num_blocks):
            block = popleft()
            if block.block_hash is not None:
                # Lazy eviction: the content stays findable until the block is reused.
                if cached.get(block.block_hash) is block:
                    del cached[block.block_hash]
                    if host_tier is not None:
                        host_tier.save(block.block_hash, block.block_id)
                    if events is not None:
                        events.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks; a free one leaves the free queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching zero join the free queue in order.

        Cached blocks go to the tail (LRU); blocks with no cached content go to the head,
        so they are reused before any block whose content a later request could hit.
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than taken"
            if block.ref_cnt == 0 and not block.is_null:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        request: Any = None,
        block_size: int = 0,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under their content hashes
        (`request`, `block_size`: for the KV events of the blocks stored)."""
        if not self.enable_caching:
            return
        cached = self.cached_block_hash_to_block
        host_tier, events = self.host_tier, self.kv_events
        stored = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a cache hit: already registered
            block_hash = block_hashes[i]
            if block_hash in cached:
                continue  # the same content computed twice; the first copy stays the one
            block.block_hash = block_hash
            cached[block_hash] = block
            if host_tier is not None:
                host_tier.note_computed_this_step(block.block_id)
            if events is not None:
                stored.append(i)
        if stored and request is not None:
            events.stored(block_hashes, stored, request, block_size)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True
