"""KVEventsConfig: publishing the prefix cache's block events (vLLM's --kv-events-config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from xlm.config.checks import _require, parse_json_text

KV_EVENT_PUBLISHERS = ("zmq", "null")


@dataclass
class KVEventsConfig:
    """Where the engine publishes BlockStored / BlockRemoved / AllBlocksCleared events
    (xlm.core.kv_events): a ZeroMQ PUB socket bound at ``endpoint``, each batch sent as
    the frames (topic, sequence number, msgpack batch)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    # Messages the socket queues per subscriber before dropping (ZeroMQ's send HWM).
    hwm: int = 100_000

    def __post_init__(self) -> None:
        owner = "KVEventsConfig"
        _require(
            self.publisher in KV_EVENT_PUBLISHERS,
            owner,
            "publisher",
            self.publisher,
            f"one of {list(KV_EVENT_PUBLISHERS)}",
        )
        _require(
            isinstance(self.endpoint, str) and "://" in self.endpoint,
            owner,
            "endpoint",
            self.endpoint,
            "a ZeroMQ endpoint such as tcp://127.0.0.1:5557",
        )
        _require(isinstance(self.hwm, int) and self.hwm >= 0, owner, "hwm", self.hwm, ">= 0")

    def for_rank(self, rank: int) -> KVEventsConfig:
        """Data-parallel rank `rank`'s config: each rank binds its own endpoint. Rank 0 keeps
        the endpoint; rank r > 0 binds port + r (tcp) or the endpoint with "-dp<r>" after
        it (ipc, inproc)."""
        if rank == 0:
            return self
        if self.endpoint.startswith("tcp://"):
            host, _, port = self.endpoint.rpartition(":")
            _require(port.isdigit(), "KVEventsConfig", "endpoint", self.endpoint, "a tcp port")
            endpoint = f"{host}:{int(port) + rank}"
        else:
            endpoint = f"{self.endpoint}-dp{rank}"
        return dataclasses.replace(self, endpoint=endpoint)

    @property
    def connect_endpoint(self) -> str:
        """Where a subscriber on this host connects (a wildcard tcp host becomes 127.0.0.1)."""
        for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
            if self.endpoint.startswith(wildcard):
                return "tcp://127.0.0.1:" + self.endpoint[len(wildcard) :]
        return self.endpoint

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent at all."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_dict(cls, value: Any) -> KVEventsConfig | None:
        """From a dict or its JSON text; None passes."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = parse_json_text("kv_events_config", value)
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config={value!r} is invalid: must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"kv_events_config has unknown keys {unknown}; known keys: {sorted(known)}"
            )
        return cls(**value)
