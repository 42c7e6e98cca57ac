"""The runner's persistent host-side batch: one numpy row per running request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps about a request between steps (also while it is preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    output_token_ids: list[int] = field(default_factory=list)
    slot: int = -1
    # Prompt positions whose logprobs were already emitted (a recompute skips them).
    num_prompt_logprobs_done: int = 0


class InputBatch:
    """Fixed-capacity rows of token ids, computed counts and block tables, updated in place."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return self.max_num_reqs - len(self._free_slots)

    def add(self, state: CachedRequestState, block_ids: list[int], num_computed: int) -> None:
        """Give a request a row: its known tokens, block table and computed count."""
        slot = self._free_slots.pop()
        state.slot = slot
        self.requests[state.req_id] = state
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[slot, : len(tokens)] = tokens
        self.num_tokens[slot] = len(tokens)
        self.num_computed_tokens[slot] = num_computed
        self.num_blocks[slot] = 0
        self.append_blocks(slot, block_ids)

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        start = self.num_blocks[slot]
        self.block_table[slot, start : start + len(block_ids)] = block_ids
        self.num_blocks[slot] = start + len(block_ids)

    def release(self, req_id: str, forget: bool) -> None:
        """Free a request's row; keep its state (preempted) unless `forget` (finished)."""
        state = self.requests.get(req_id)
        if state is None:
            return
        if state.slot >= 0:
            self._free_slots.append(state.slot)
            state.slot = -1
        if forget:
            del self.requests[req_id]

    def append_token(self, slot: int, token_id: int) -> None:
        n = self.num_tokens[slot]
        if n < self.max_model_len:  # the scheduler stops the request at max_model_len
            self.token_ids[slot, n] = token_id
            self.num_tokens[slot] = n + 1
