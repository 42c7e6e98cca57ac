"""What the scheduler hands the model runner each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class NewRequestData:
    """A request the workers have not seen: everything needed to start it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    # One list, or with several KV cache groups one list per group (a tuple).
    block_ids: list[int] | tuple[list[int], ...]
    # Prefix-cache hit: tokens whose K/V already sit in the first blocks.
    num_computed_tokens: int
    # A pooling request: its prompt is pooled into one vector instead of sampled.
    pooling_params: Any = None
    # Its LoRA adapter (xlm.lora.request.LoRARequest), or None: the base model.
    lora_request: Any = None
    # Its images (xlm.multimodal.inputs.MultiModalFeature), or None.
    mm_features: Any = None


@dataclass(slots=True)
class CachedRequestData:
    """Requests the workers already hold, as parallel lists (one row per request).

    For a running request, new_block_ids are the blocks appended to its table this step and
    new_token_ids is empty (the runner appended what it sampled). For a request resumed from
    preemption, new_block_ids is its whole new table and new_token_ids all of its output
    tokens: the runner resets the request to prompt + those tokens.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Per request: one list, or with several KV cache groups a tuple of one list per group.
    new_block_ids: list[Any] = field(default_factory=list)
    # Tokens whose K/V are in the cache before this step.
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        """Number of rows."""
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step: which requests run, how many tokens each, and who to drop."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # Tokens to compute per request this step, in batch order (running, then new).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Finished or aborted since the last step: workers drop their state.
    finished_req_ids: set[str]
    # Preempted this step: workers drop them from the batch (they come back as resumed).
    preempted_req_ids: set[str]
    # Constrained requests that sample this step, and their allowed-token bitmasks:
    # int32 [len(structured_output_request_ids), ceil(V / 32)] (row i for request i).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # Speculative decoding: the proposed tokens scheduled after each request's last token
    # (counted in num_scheduled_tokens); requests without proposals are absent.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Host KV tier (xlm.core.host_kv_tier.HostKVTransfers): the block copies the workers do
    # before this step's forward; None: none.
    kv_transfers: Any = None


@dataclass
class LogprobsLists:
    """Logprobs of several positions as host lists (what EngineCoreOutput carries).

    Row j: ``logprob_token_ids[j][0]`` is the token at that position (sampled, or the
    prompt token), followed by the top-k ids in rank order; ``logprobs`` likewise;
    ``sampled_token_ranks[j]`` is the 1-based rank of the first one.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    @classmethod
    def from_sampler(
        cls, token_ids: Any, logprobs: Any, ranks: Any, topk_ids: Any, topk_logprobs: Any
    ) -> LogprobsLists:
        """From a SamplerOutput's rows (or compute_prompt_logprobs') of one request."""
        ids = [[int(t), *map(int, row)] for t, row in zip(token_ids, topk_ids)]
        lps = [[float(lp), *map(float, row)] for lp, row in zip(logprobs, topk_logprobs)]
        return cls(ids, lps, [int(r) for r in ranks])


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens per request; an empty list for a prefill chunk that is not the last."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Aligned with req_ids when logprobs were requested.
    logprobs: list[LogprobsLists | None] | None = None
    prompt_logprobs: dict[str, LogprobsLists] | None = None
    # Pooling runner: per request, its vector (float32 numpy) once its prompt is computed.
    pooler_output: list[Any] | None = None
    # Speculative decoding: per request (aligned with req_ids), the tokens proposed to
    # follow what it sampled; None when nothing was proposed.
    spec_token_ids: list[list[int]] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one request from one step, and why it finished if it did."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: Any = None
    new_prompt_logprobs: Any = None
    num_cached_tokens: int = 0
    # When the scheduler first picked the request (time.time()); None if unknown.
    first_scheduled_time: float | None = None
    # A pooling request's vector (float32 numpy), sent with its one and last output.
    pooled: Any = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last output."""
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    """Scheduler and KV cache state for metrics (counters are cumulative)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    # Tokens scheduled in the last step, and all steps so far.
    step_num_scheduled_tokens: int = 0
    total_num_scheduled_tokens: int = 0
    # Step programs ready of all registered (the rest compile in the background).
    programs_ready: int = 0
    programs_total: int = 0
    # Speculative decoding (cumulative): verifications (a request's proposals checked in
    # one step), tokens proposed and tokens accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Host KV tier (0 without one): fraction of its slots in use, prompt tokens loaded
    # from it instead of computed, and bytes copied each way (cumulative).
    host_kv_cache_usage: float = 0.0
    host_kv_cache_hits: int = 0
    host_kv_bytes_to_host: int = 0
    host_kv_bytes_to_device: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted of proposed tokens, cumulative (0 before any proposal)."""
        if not self.spec_num_draft_tokens:
            return 0.0
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verified request gains per step: accepted proposals plus the one the
        step samples anyway (1.0 means speculation gained nothing)."""
        if not self.spec_num_drafts:
            return 0.0
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cumulative fraction of looked-up tokens found in the prefix cache."""
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
