"""The router's subscriber over real ZeroMQ sockets: two ranks' publishers on their own
endpoints feed one PrefixCacheIndex (stored, removed, by rank), and a gap in a rank's
sequence numbers (missed batches) forgets what the index knew of that rank."""

from __future__ import annotations

import time

from xlm.config import KVEventsConfig
from xlm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from xlm.engine.kv_events_publisher import ZmqEventPublisher
from xlm.engine.kv_events_subscriber import KVEventSubscriber, PrefixCacheIndex

H = [bytes([i]) * 32 for i in range(4)]


def _wait(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _stored(*hashes: bytes) -> BlockStored:
    return BlockStored(list(hashes), None, [], 4)


def test_two_ranks_events_build_one_index_and_a_gap_forgets_a_rank(tmp_path):
    config = KVEventsConfig(True, endpoint=f"ipc://{tmp_path / 'ev'}", topic="kv")
    pubs = [ZmqEventPublisher(config.for_rank(r), data_parallel_rank=r) for r in range(2)]
    index = PrefixCacheIndex(2)
    sub = KVEventSubscriber([config.for_rank(r).connect_endpoint for r in range(2)], "kv", index)
    try:
        # A SUB socket misses what is sent before it has joined: repeat a harmless batch.
        def joined() -> bool:
            for pub in pubs:
                pub.publish([AllBlocksCleared()])
            time.sleep(0.02)
            return sub.num_batches >= 2 and all(s is not None for s in sub._next_seq)

        _wait(joined, "the subscriber to join both ranks")
        pubs[0].publish([_stored(H[0], H[1])])
        pubs[1].publish([_stored(H[0])])
        _wait(lambda: index.num_blocks(0) == 2 and index.num_blocks(1) == 1, "BlockStored")
        prefix = index.longest_prefix(lambda i: H[i], 3, [0, 1])
        assert prefix == ({0}, 2)
        pubs[0].publish([BlockRemoved([H[1]])])
        _wait(lambda: index.num_blocks(0) == 1, "BlockRemoved")
        assert index.longest_prefix(lambda i: H[i], 3, [0, 1]) == ({0, 1}, 1)
        # Rank 1 misses a batch (as when its socket drops one): it starts over.
        pubs[1]._seq += 1
        pubs[1].publish([_stored(H[2])])
        _wait(lambda: index.longest_prefix(lambda i: H[2], 1, [1])[1] == 1, "the next batch")
        assert index.num_blocks(1) == 1  # H[0] forgotten, H[2] known
        assert index.longest_prefix(lambda i: H[i], 1, [1]) == (set(), 0)
    finally:
        sub.shutdown()
        for pub in pubs:
            pub.shutdown()
    assert not sub._thread.is_alive()
