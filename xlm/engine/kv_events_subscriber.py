"""The data-parallel router's view of its ranks' prefix caches, built from their KV events.

Each rank publishes its block events on its own endpoint (`KVEventsConfig.for_rank`); one
background thread subscribes to every rank's PUB socket and applies each batch to a
`PrefixCacheIndex`: block hash -> the ranks whose device prefix cache holds it. The router
(xlm.engine.dp_client) asks the index which ranks hold the longest prefix of a request's
block hashes. A rank's missed batches (a gap in its sequence numbers) or a prefix-cache
reset forget everything the index knew of that rank: better no affinity than a stale one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from xlm.core.kv_cache_utils import BlockHash
from xlm.core.kv_events import decode_event_batch
from xlm.logger import init_logger

logger = init_logger(__name__)

# How long the subscriber thread waits for a batch before it checks for shutdown.
POLL_MS = 100
# How long the subscriber waits for each rank's connection at start.
JOIN_TIMEOUT_MS = 10_000


class PrefixCacheIndex:
    """Block hash -> ranks holding it, counted (several KV cache groups store one hash once
    per group); thread-safe: the subscriber thread writes, the router reads."""

    def __init__(self, num_ranks: int) -> None:
        self._lock = threading.Lock()
        self._holders: dict[BlockHash, dict[int, int]] = {}
        self.num_ranks = num_ranks

    def apply(self, rank: int, events: list[list[Any]]) -> None:
        """One batch of a rank's events (xlm.core.kv_events lists) in order."""
        with self._lock:
            for event in events:
                kind = event[0]
                if kind == "BlockStored":
                    for block_hash in event[1]:
                        ranks = self._holders.setdefault(block_hash, {})
                        ranks[rank] = ranks.get(rank, 0) + 1
                elif kind == "BlockRemoved":
                    for block_hash in event[1]:
                        self._remove(block_hash, rank)
                elif kind == "AllBlocksCleared":
                    self._clear_rank(rank)

    def _remove(self, block_hash: BlockHash, rank: int) -> None:
        ranks = self._holders.get(block_hash)
        if ranks is None or rank not in ranks:
            return
        ranks[rank] -= 1
        if ranks[rank] <= 0:
            del ranks[rank]
            if not ranks:
                del self._holders[block_hash]

    def clear_rank(self, rank: int) -> None:
        """Forget every block of a rank (reset, missed events, a dead rank)."""
        with self._lock:
            self._clear_rank(rank)

    def _clear_rank(self, rank: int) -> None:
        for block_hash in [h for h, ranks in self._holders.items() if rank in ranks]:
            self._remove_all(block_hash, rank)

    def _remove_all(self, block_hash: BlockHash, rank: int) -> None:
        ranks = self._holders[block_hash]
        del ranks[rank]
        if not ranks:
            del self._holders[block_hash]

    def num_blocks(self, rank: int) -> int:
        """Distinct block hashes the rank holds."""
        with self._lock:
            return sum(1 for ranks in self._holders.values() if rank in ranks)

    def longest_prefix(
        self, hash_at: Callable[[int], BlockHash], num_blocks: int, ranks: Iterable[int]
    ) -> tuple[set[int], int]:
        """Of `ranks`, those holding the longest run of blocks hash_at(0), hash_at(1), ...
        (at most num_blocks; hashes asked for lazily, up to the first no rank holds), and
        its length; (set(), 0) when none holds the first block."""
        best: set[int] = set()
        length = 0
        candidates = set(ranks)
        with self._lock:
            for i in range(num_blocks):
                holders = self._holders.get(hash_at(i))
                if not holders:
                    break
                candidates &= holders.keys()
                if not candidates:
                    break
                best, length = candidates, i + 1
        return best, length


class KVEventSubscriber:
    """A thread subscribed to every rank's KV events endpoint, feeding a PrefixCacheIndex."""

    def __init__(self, endpoints: list[str | None], topic: str, index: PrefixCacheIndex) -> None:
        import zmq

        self._zmq = zmq
        self.index = index
        self._context = zmq.Context()
        self._sockets = []
        self._ranks: dict[Any, int] = {}  # socket -> rank (endpoint None: a rank unheard)
        for rank, endpoint in enumerate(endpoints):
            if endpoint is None:
                continue
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
            monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            socket.connect(endpoint)
            self._wait_joined(socket, monitor, endpoint)
            self._sockets.append(socket)
            self._ranks[socket] = rank
        self._next_seq: list[int | None] = [None] * len(endpoints)
        self.num_batches = 0  # batches applied (tests wait on it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xlm-kv-events", daemon=True)
        self._thread.start()

    def _wait_joined(self, socket: Any, monitor: Any, endpoint: str) -> None:
        """Wait until the connection to a rank's PUB socket is up: a PUB drops what it sends
        before a subscriber has joined, and a rank's first step publishes at once."""
        if monitor.poll(JOIN_TIMEOUT_MS):
            monitor.recv_multipart()
        else:
            logger.warning("KV events at %s: not joined yet; early events may be missed", endpoint)
        socket.disable_monitor()
        monitor.close()

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        for socket in self._sockets:
            poller.register(socket, zmq.POLLIN)
        rank_of = self._ranks
        try:
            while not self._stop.is_set():
                for socket, _ in poller.poll(POLL_MS):
                    self._drain(socket, rank_of[socket])
        except Exception:  # the router falls back to load; serving goes on
            logger.exception("KV event subscriber stopped; routing by load from now on")
            for rank in self._ranks.values():
                self.index.clear_rank(rank)
        finally:
            for socket in self._sockets:
                socket.close()

    def _drain(self, socket: Any, rank: int) -> None:
        while True:
            try:
                _, seq_bytes, payload = socket.recv_multipart(flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                return
            seq = int.from_bytes(seq_bytes, "big")
            expected = self._next_seq[rank]
            if expected is not None and seq != expected:
                logger.warning(
                    "KV events of data-parallel rank %d: batches %d..%d missed; its prefix "
                    "affinity starts over",
                    rank,
                    expected,
                    seq - 1,
                )
                self.index.clear_rank(rank)
            self._next_seq[rank] = seq + 1
            _, events, _ = decode_event_batch(payload)
            self.index.apply(rank, events)
            self.num_batches += 1

    def shutdown(self) -> None:
        """Stop the thread and close the sockets."""
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # it closed its sockets: term() returns at once
            self._context.term()
