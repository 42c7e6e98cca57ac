"""The KV-manager interface the scheduler types against.

Two managers implement it: ``KVCacheManager`` (one block table per request) and
``HybridKVCacheManager`` (one table per KV cache group, over one shared pool). Block ids
go out as a list (one group) or a tuple of lists (one per group); the scheduler passes
them through to the runner without looking inside.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from xlm.core.request import Request

# A request's block ids: one list, or one list per KV cache group.
BlockIds = Sequence[int] | tuple[Sequence[int], ...]


@runtime_checkable
class KVManager(Protocol):
    """Paged KV blocks of every request: admission checks, prefix-cache hits, allocation."""

    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        ...

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests may hold together (all but the null block)."""
        ...

    @property
    def max_request_tokens(self) -> int:
        """The longest request the whole pool holds alone."""
        ...

    def num_blocks_to_fit(self, num_tokens: int) -> int:
        """Blocks a request of num_tokens needs at most, alone."""
        ...

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever fit, alone, in the whole pool."""
        ...

    def get_computed_blocks(self, request: Request) -> tuple[Any, int]:
        """The longest cached prefix: (blocks, token count); ([], 0) on a miss."""
        ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
    ) -> BlockIds | None:
        """Slots for num_new_tokens more tokens: the new block ids, None if blocks run out."""
        ...

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now."""
        ...

    def free(self, request: Request) -> None:
        """Release the request's blocks."""
        ...

    def get_block_ids(self, request_id: str) -> BlockIds:
        """The request's block table (one per group for several groups)."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False while any block is in use."""
        ...
