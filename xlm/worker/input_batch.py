"""The runner's persistent host-side batch: all per-request state, one numpy row per slot.

Updated incrementally from each SchedulerOutput (new, finished, preempted and resumed
requests, new blocks) and from each step's sampled tokens; nothing of size
[rows, max_model_len] is rebuilt per step. The sampler's per-request state lives here
too (``SamplingRows``), resolved once per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xlm.core.outputs import SchedulerOutput
from xlm.worker.sampler import SamplingMetadata
from xlm.worker.sampling_rows import SamplingRows
from xlm.worker.spec_decode import may_speculate

# A request's block ids: one list, or one list per KV cache group (xlm.core.kv_cache_groups).
BlockIds = list[int] | tuple[list[int], ...]


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
    # A pooling request's PoolingParams (its vector replaces sampling).
    pooling_params: Any = None
    # Whether speculative decoding may propose it tokens, and how often its proposals
    # were accepted (xlm.worker.spec_decode.SpeculationPolicy).
    may_speculate: bool = False
    spec_acceptance: float = 0.6
    # Its LoRA adapter (xlm.lora.request.LoRARequest; None: the base model).
    lora_request: Any = None
    # Its images (xlm.multimodal.inputs.MultiModalFeature), in prompt order; None: none.
    mm_features: Any = None


class InputBatch:
    """Fixed-capacity rows of token ids, computed counts, block tables and sampler state."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # Several KV cache groups: one table per group, stacked first ([G, rows, blocks]).
        groups = (num_kv_groups,) if num_kv_groups > 1 else ()
        self.block_table = np.zeros((*groups, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros((*groups, max_num_reqs), dtype=np.int32)
        self.sampling = SamplingRows(max_num_reqs, vocab_size, max_model_len)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return self.max_num_reqs - len(self._free_slots)

    # ---- updates from the scheduler -----------------------------------------------------
    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a step's SchedulerOutput: finished, preempted, new and cached requests."""
        for req_id in scheduler_output.finished_req_ids:
            self.release(req_id, forget=True)
        for req_id in scheduler_output.preempted_req_ids:
            self.release(req_id, forget=False)
        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                new.sampling_params,
                pooling_params=new.pooling_params,
                may_speculate=new.pooling_params is None and may_speculate(new.sampling_params),
                lora_request=new.lora_request,
                mm_features=new.mm_features,
            )
            self.add(state, new.block_ids, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            if cached.resumed_from_preemption[i]:
                if state.slot >= 0:
                    self.release(req_id, forget=False)
                state.output_token_ids = list(cached.new_token_ids[i])
                self.add(state, cached.new_block_ids[i], cached.num_computed_tokens[i])
            else:
                self.append_blocks(state.slot, cached.new_block_ids[i])
                self.num_computed_tokens[state.slot] = cached.num_computed_tokens[i]

    def add(self, state: CachedRequestState, block_ids: BlockIds, num_computed: int) -> None:
        """Give a request a row: its known tokens, block table, computed count, sampler row."""
        slot = self._free_slots.pop()
        state.slot = slot
        self.requests[state.req_id] = state
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[slot, : len(tokens)] = tokens
        self.num_tokens[slot] = len(tokens)
        self.num_computed_tokens[slot] = num_computed
        self.num_blocks[..., slot] = 0
        self.append_blocks(slot, block_ids)
        self.sampling.add(
            slot, state.sampling_params, state.prompt_token_ids, state.output_token_ids
        )

    def append_blocks(self, slot: int, block_ids: BlockIds) -> None:
        if isinstance(block_ids, tuple):  # one list per KV cache group
            for g, ids in enumerate(block_ids):
                start = self.num_blocks[g, slot]
                self.block_table[g, slot, start : start + len(ids)] = ids
                self.num_blocks[g, slot] = start + len(ids)
            return
        start = self.num_blocks[slot]
        self.block_table[slot, start : start + len(block_ids)] = block_ids
        self.num_blocks[slot] = start + len(block_ids)

    def release(self, req_id: str, forget: bool) -> None:
        """Free a request's row; keep its state (preempted) unless `forget` (finished)."""
        state = self.requests.get(req_id)
        if state is None:
            return
        if state.slot >= 0:
            self.sampling.remove(state.slot)
            self._free_slots.append(state.slot)
            state.slot = -1
        if forget:
            del self.requests[req_id]

    # ---- updates from a step's results --------------------------------------------------
    def advance(self, req_ids: list[str], num_scheduled: list[int]) -> None:
        """Count the tokens a step computed."""
        for req_id, n in zip(req_ids, num_scheduled):
            self.num_computed_tokens[self.requests[req_id].slot] += n

    def append_sampled(self, state: CachedRequestState, token_id: int) -> None:
        """Record a token the request sampled: its output, its row and its sampler row."""
        state.output_token_ids.append(token_id)
        slot = state.slot
        n = self.num_tokens[slot]
        if n < self.max_model_len:  # the scheduler stops the request at max_model_len
            self.token_ids[slot, n] = token_id
            self.num_tokens[slot] = n + 1
        self.sampling.append_output(slot, token_id)

    # ---- reads for a step ---------------------------------------------------------------
    def slots(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter((self.requests[r].slot for r in req_ids), np.int32, len(req_ids))

    def sampling_metadata(
        self,
        slots: np.ndarray,
        num_rows: int,
        step_seed: int,
        grammar_bitmask: dict[int, np.ndarray] | None = None,
        drafts: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> SamplingMetadata:
        """The sampler's inputs for these slots, padded to `num_rows` (plus the
        structured-output bitmask rows, by position in `slots`, and the proposed tokens
        of speculative decoding: SamplingRows.metadata)."""
        return self.sampling.metadata(slots, num_rows, step_seed, grammar_bitmask, drafts)
