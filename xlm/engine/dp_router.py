"""The data-parallel router: which rank serves each request (prefix affinity and load).

With KV events (xlm.engine.kv_events_subscriber), the rank whose prefix cache holds the
longest prefix of the request's block hashes (the engine's own hashes, so an evicted prefix
stops attracting requests as soon as its BlockRemoved arrives); before a prefix's events
arrive, the rank a request in flight with the same first block went to. Without events,
the rank that last served the same first full block. Either way, unless that rank has more
than `slack` requests more in flight than the least loaded; otherwise the least loaded rank
(requests in flight = waiting + running, as the client counts them).
"""

from __future__ import annotations

from collections import OrderedDict

from xlm.core.kv_cache_utils import BlockHash, update_block_hashes
from xlm.engine.exceptions import EngineDeadError
from xlm.engine.kv_events_subscriber import PrefixCacheIndex
from xlm.engine.messages import EngineCoreRequest

# Prefix -> rank entries the router remembers (least recently used dropped first).
MAX_PREFIXES = 65536


def affinity_slack(max_num_seqs: int) -> int:
    """How many more requests in flight the prefix's rank may have than the least loaded
    rank and still get the request: a quarter of a full batch, at least 2."""
    return max(2, max_num_seqs // 4)


class PromptBlocks:
    """A prompt's block hashes, computed on demand as the engine computes them
    (xlm.core.kv_cache_utils.update_block_hashes reads these fields of a Request)."""

    __slots__ = (
        "all_token_ids",
        "block_hashes",
        "block_size",
        "cache_salt",
        "lora_request",
        "mm_features",
    )

    def __init__(self, request: EngineCoreRequest, block_size: int) -> None:
        self.all_token_ids = request.prompt_token_ids
        self.cache_salt = request.cache_salt
        self.lora_request = request.lora_request
        self.mm_features = request.mm_features
        self.block_hashes: list[BlockHash] = []
        self.block_size = block_size

    @property
    def num_full_blocks(self) -> int:
        return len(self.all_token_ids) // self.block_size

    def hash_at(self, i: int) -> BlockHash:
        """Block i's hash (blocks 0..i hashed now if they were not)."""
        return update_block_hashes(self, self.block_size, i + 1)[i]  # type: ignore[arg-type]


class DataParallelRouter:
    """Chooses a rank per request by prefix affinity and load; tracks requests in flight.

    `prefix_index`: the ranks' prefix caches from their KV events (None: events off, the
    router goes by its own record of where each first block went)."""

    def __init__(
        self,
        num_engines: int,
        block_size: int,
        slack: int,
        prefix_index: PrefixCacheIndex | None = None,
    ) -> None:
        self.block_size = block_size
        self.slack = slack
        self.loads = [0] * num_engines
        self.alive = [True] * num_engines
        self.request_rank: dict[str, int] = {}
        self.prefix_index = prefix_index
        # First block hash -> the rank it went to last. With events, an entry lives while
        # a request with that first block is in flight (it bridges the time until the
        # rank's BlockStored arrives); without, the newest MAX_PREFIXES stay.
        self.prefix_rank: OrderedDict[BlockHash, int] = OrderedDict()
        self._prefix_uses: dict[BlockHash, int] = {}
        self._request_prefix: dict[str, BlockHash] = {}
        self._next = 0  # where the least-loaded search starts: ties rotate over ranks

    def prefix_key(self, request: EngineCoreRequest) -> BlockHash | None:
        """The hash of the prompt's first full block (the engine's block hash: cache salt,
        LoRA adapter and images in it); None for a prompt shorter than a block."""
        blocks = PromptBlocks(request, self.block_size)
        return blocks.hash_at(0) if blocks.num_full_blocks else None

    def choose(self, request: EngineCoreRequest) -> int:
        """The rank for a new request (counted in flight there until `finish`)."""
        live = [r for r, ok in enumerate(self.alive) if ok]
        if not live:
            raise EngineDeadError("every data-parallel engine is dead")
        least = self._least_loaded(live)
        blocks = PromptBlocks(request, self.block_size)
        key = blocks.hash_at(0) if blocks.num_full_blocks else None
        rank = None
        if key is not None and self.prefix_index is not None:
            holders, _ = self.prefix_index.longest_prefix(
                blocks.hash_at, blocks.num_full_blocks, live
            )
            if holders:
                rank = min(holders, key=lambda r: (self.loads[r], r))
        if rank is None and key is not None:
            rank = self.prefix_rank.get(key)
        if (
            rank is None
            or not self.alive[rank]
            or self.loads[rank] - self.loads[least] > self.slack
        ):
            rank = least
        if key is not None:
            self._record(request.request_id, key, rank)
        self.loads[rank] += 1
        self.request_rank[request.request_id] = rank
        return rank

    def _record(self, request_id: str, key: BlockHash, rank: int) -> None:
        self.prefix_rank[key] = rank
        self.prefix_rank.move_to_end(key)
        if self.prefix_index is None:
            if len(self.prefix_rank) > MAX_PREFIXES:
                self.prefix_rank.popitem(last=False)
            return
        self._prefix_uses[key] = self._prefix_uses.get(key, 0) + 1
        self._request_prefix[request_id] = key

    def _forget(self, request_id: str) -> None:
        """A request left: with events, its first block's record goes with the last one."""
        key = self._request_prefix.pop(request_id, None)
        if key is None:
            return
        uses = self._prefix_uses[key] - 1
        if uses:
            self._prefix_uses[key] = uses
        else:
            del self._prefix_uses[key]
            self.prefix_rank.pop(key, None)

    def _least_loaded(self, live: list[int]) -> int:
        n = len(self.loads)
        order = sorted(live, key=lambda r: (self.loads[r], (r - self._next) % n))
        self._next = (order[0] + 1) % n
        return order[0]

    def rank_of(self, request_id: str) -> int | None:
        """The rank a request in flight runs on."""
        return self.request_rank.get(request_id)

    def finish(self, request_id: str) -> None:
        """A request finished or was aborted: no longer in flight."""
        rank = self.request_rank.pop(request_id, None)
        if rank is not None:
            self.loads[rank] -= 1
            self._forget(request_id)

    def mark_dead(self, rank: int) -> list[str]:
        """Route nothing more to `rank`; returns the requests that were in flight there."""
        self.alive[rank] = False
        lost = [r for r, k in self.request_rank.items() if k == rank]
        for request_id in lost:
            del self.request_rank[request_id]
            self._forget(request_id)
        self.loads[rank] = 0
        for key in [k for k, r in self.prefix_rank.items() if r == rank]:
            del self.prefix_rank[key]
        if self.prefix_index is not None:
            self.prefix_index.clear_rank(rank)
        return lost
