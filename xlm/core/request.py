"""A request as the engine core sees it: tokens, progress, status and stop state."""

from __future__ import annotations

import enum
import time
from typing import Any

from xlm.sampling_params import uses_output_bans, uses_penalties


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """Whether the status is one of the finished ones."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """The OpenAI-style finish reason ("stop", "length", "abort", "error") or None."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request: prompt, outputs so far, progress through the KV cache."""

    __slots__ = (
        "skip_prefix_cache",
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "cache_salt",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "first_scheduled_time",
        "status",
        "stop_reason",
        "block_hashes",
        "num_preemptions",
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "structured_output_request",
        "num_output_placeholders",
        "host_tokens_only",
        "pooling_params",
        "spec_token_ids",
        "lora_request",
        "mm_features",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: Any = None,
        lora_request: Any = None,
        mm_features: list[Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        # Prompt then outputs; kept alongside output_token_ids so block hashing slices one list.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prefix-cache hit (tokens) at the first schedule; -1 until then.
        self.num_cached_tokens = -1
        # When the scheduler first picked it (time.time(), the clock of arrival_time).
        self.first_scheduled_time: float | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Hashes of this request's full blocks, in order; the KV cache manager extends it.
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        # Sampling fields read on every token, copied once (sampling_params is duck-typed).
        self.max_tokens: int | None = sampling_params.max_tokens
        self.min_tokens: int = sampling_params.min_tokens or 0
        self.ignore_eos: bool = bool(sampling_params.ignore_eos)
        self.stop_token_ids: frozenset[int] = frozenset(sampling_params.stop_token_ids or ())
        # A pooling request: prefilled whole in one step, pooled, finished (never sampled).
        self.pooling_params = pooling_params
        # Prompt logprobs need logits at every prompt position, and mean or first-token
        # pooling the hidden state of every prompt token: no cached prefix for those.
        self.skip_prefix_cache = getattr(sampling_params, "prompt_logprobs", None) is not None
        if pooling_params is not None and not pooling_params.uses_last_token_only:
            self.skip_prefix_cache = True
        # The constraint's matcher state (xlm.structured_output.manager), set on admission.
        self.structured_output_request: Any = None
        # Async scheduling: tokens sampled by steps in flight, not yet appended.
        self.num_output_placeholders = 0
        # Whether the next step's sampling inputs depend on the latest token's value (the
        # penalties' counts, bad-word and min_tokens bans; a grammar, set on admission):
        # such a request is not scheduled while a token of it is in flight.
        self.host_tokens_only = uses_penalties(sampling_params) or uses_output_bans(sampling_params)
        # Speculative decoding: tokens proposed to follow the last one, to be verified by
        # the next step that schedules the request.
        self.spec_token_ids: list[int] = []
        # The LoRA adapter (xlm.lora.request.LoRARequest); None: the base model.
        self.lora_request = lora_request
        # Its images (xlm.multimodal.inputs.MultiModalFeature) in prompt order; None: none.
        self.mm_features = mm_features or None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """Whether the request has finished for any reason."""
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        """ "stop", "length", "abort", "error", or None while unfinished."""
        return _FINISHED_REASONS.get(self.status)

    def append_output_token_ids(self, token_id: int) -> None:
        """Record one sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
