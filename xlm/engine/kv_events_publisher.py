"""Publishes the prefix cache's block events on a ZeroMQ PUB socket (--kv-events-config).

Each batch goes out as three frames: the topic, an 8-byte big-endian sequence number
(a subscriber sees a gap when it missed batches) and the msgpack batch
(xlm.core.kv_events.encode_event_batch). Sends never block the step loop: a subscriber
that falls behind by more than `hwm` batches loses the newest ones (ZeroMQ drops them).
"""

from __future__ import annotations

from xlm.config import KVEventsConfig
from xlm.core.kv_events import KVCacheEvent, encode_event_batch
from xlm.logger import init_logger

logger = init_logger(__name__)


class ZmqEventPublisher:
    """A PUB socket bound at the config's endpoint; publish() sends one batch."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(config.endpoint)
        self._topic = config.topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0
        logger.info("KV cache events published on %s (topic %r).", config.endpoint, config.topic)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send the events as one batch (nothing when there are none)."""
        if not events:
            return
        payload = encode_event_batch(events, self._rank)
        seq = self._seq.to_bytes(8, "big")
        self._seq += 1
        try:
            self._socket.send_multipart((self._topic, seq, payload), flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            logger.debug("KV event batch %d dropped: no room on the socket", self._seq - 1)

    def shutdown(self) -> None:
        self._socket.close()
        self._context.term()


def make_kv_event_publisher(
    config: KVEventsConfig | None, data_parallel_rank: int = 0
) -> ZmqEventPublisher | None:
    """The publisher a config asks for, or None (events off)."""
    if config is None or not config.publishes:
        return None
    return ZmqEventPublisher(config, data_parallel_rank)
