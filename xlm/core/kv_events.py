"""KV cache events: which prefix blocks the device pool stored and removed, for a router.

The block pool records one event per change (xlm.core.block_pool); the engine core takes
the step's events and publishes them as one batch (xlm.engine.kv_events_publisher). The
wire shape follows vLLM's `--kv-events-config` events, msgpack-encoded: a batch is
``[timestamp, [event, ...], data_parallel_rank]`` and each event a list led by its
type name:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name]``: full blocks entered in the prefix cache, in chain order;
  ``parent_block_hash`` is the hash of the block before the first (None: the first block
  of the sequence); ``token_ids`` are all of their tokens.
- ``["BlockRemoved", block_hashes, medium]``: blocks evicted from the prefix cache.
- ``["AllBlocksCleared"]``: the prefix cache was reset.

Block hashes are xlm's 32-byte sha256 block hashes (msgpack bin).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from xlm.core.kv_cache_utils import BlockHash


@dataclass(slots=True)
class BlockStored:
    """Full blocks entered in the prefix cache (one chain)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None

    def as_list(self) -> list[Any]:
        return [
            "BlockStored",
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.lora_id,
            self.medium,
            self.lora_name,
        ]


@dataclass(slots=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache."""

    block_hashes: list[BlockHash]
    medium: str | None = None

    def as_list(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset."""

    def as_list(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _plain_hash(key: Hashable) -> BlockHash:
    """A prefix-cache key's block hash (several KV cache groups key by (group, hash))."""
    return key[1] if isinstance(key, tuple) else key


@dataclass(slots=True)
class KVEventRecorder:
    """The events of the step being scheduled (the block pool appends, the core takes)."""

    events: list[KVCacheEvent] = field(default_factory=list)

    def stored(
        self, keys: Sequence[Hashable], indices: list[int], request: Any, block_size: int
    ) -> None:
        """Blocks keys[i] for i in indices (ascending) of `request` entered the cache."""
        tokens = request.all_token_ids
        lora = request.lora_request
        run: list[int] = []
        for i in indices:
            if run and i != run[-1] + 1:
                self._stored_run(keys, run, tokens, block_size, lora)
                run = []
            run.append(i)
        self._stored_run(keys, run, tokens, block_size, lora)

    def _stored_run(
        self, keys: Sequence[Hashable], run: list[int], tokens: Any, bs: int, lora: Any
    ) -> None:
        first, last = run[0], run[-1]
        self.events.append(
            BlockStored(
                [_plain_hash(keys[i]) for i in run],
                _plain_hash(keys[first - 1]) if first > 0 else None,
                list(tokens[first * bs : (last + 1) * bs]),
                bs,
                None if lora is None else lora.lora_int_id,
                None,
                None if lora is None else lora.lora_name,
            )
        )

    def removed(self, key: Hashable) -> None:
        """A block left the prefix cache (consecutive removals share one event)."""
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(_plain_hash(key))
        else:
            self.events.append(BlockRemoved([_plain_hash(key)]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last take."""
        events, self.events = self.events, []
        return events


def encode_event_batch(
    events: list[KVCacheEvent], data_parallel_rank: int = 0, timestamp: float | None = None
) -> bytes:
    """One msgpack batch: [timestamp, [event lists], data_parallel_rank]."""
    ts = time.time() if timestamp is None else timestamp
    return msgpack.packb([ts, [e.as_list() for e in events], data_parallel_rank])


def decode_event_batch(payload: bytes) -> tuple[float, list[list[Any]], int]:
    """A batch back as (timestamp, event lists, data_parallel_rank) (subscribers, tests)."""
    ts, events, rank = msgpack.unpackb(payload)
    return ts, events, rank
