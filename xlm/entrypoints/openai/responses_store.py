"""The in-memory store of /v1/responses results, for `previous_response_id` and GET.

Bounded three ways, oldest first out: at most `max_entries` responses, none older than
`max_age_s` seconds, and at most `max_bytes` of stored JSON in all. Each entry keeps the
whole conversation up to and including its output, so a continuation never depends on
an older entry that may have been evicted. It lives in the API server process and is
lost on restart.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_AGE_S = 3600.0
# The whole store's stored JSON: a request body may be 4 MiB, so the entry count alone
# does not bound the memory.
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    """One kept response: its body and the conversation a continuation starts from."""

    response: dict[str, Any]
    # Input items of every turn up to this one, then this response's output items
    # (instructions excluded: OpenAI does not carry them over).
    conversation: list[dict[str, Any]]
    created: float
    num_bytes: int


class ResponseStore:
    """Responses by id, evicted by count, age and total size (oldest first)."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0 or max_age_s <= 0 or max_bytes < 0:
            raise ValueError(
                f"response store limits must be max_entries >= 0, max_age_s > 0, "
                f"max_bytes >= 0; got {max_entries}, {max_age_s}, {max_bytes}"
            )
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> bool:
        """Keep a response; False when it alone is over the store's size (not kept)."""
        num_bytes = len(json.dumps(response)) + len(json.dumps(conversation))
        if self.max_entries == 0 or num_bytes > self.max_bytes:
            return False
        self._drop(response_id)
        entry = StoredResponse(response, conversation, self.clock(), num_bytes)
        self._entries[response_id] = entry
        self.num_bytes += num_bytes
        self._evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The response kept under an id, unless unknown, evicted or expired."""
        self._evict()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        self._evict()
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True

    def _evict(self) -> None:
        """Drop the oldest entries while any bound is exceeded or they have expired."""
        deadline = self.clock() - self.max_age_s
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            over = len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes
            if not over and oldest.created > deadline:
                return
            self._drop(oldest_id)
