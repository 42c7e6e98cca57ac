"""Continuous batching: each step, a token budget spent on running then waiting requests."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from typing import Any

from xlm.config import CacheConfig, SchedulerConfig
from xlm.core.admission import check_new_request
from xlm.core.kv_cache_manager import KVCacheManager
from xlm.core.kv_events import KVCacheEvent
from xlm.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from xlm.core.request import Request, RequestStatus
from xlm.core.request_queue import create_request_queue
from xlm.core.sampled_tokens import append_sampled_tokens, roll_back_rejected
from xlm.core.step_plan import ImageRule, StepPlan, trim_proposals
from xlm.logger import init_logger

logger = init_logger(__name__)

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING = RequestStatus.WAITING
_STOPPED = RequestStatus.FINISHED_STOPPED
_ERROR = RequestStatus.FINISHED_ERROR


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


class Scheduler:
    """Decides what runs each step and applies what the model sampled."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output_manager: Any = None,
        max_loras: int | None = None,
        kv_events: bool = False,
    ) -> None:
        """`max_loras`: LoRA on, at most this many adapters among running requests (the
        device's slots); None: LoRA off. `kv_events`: record the prefix cache's block
        events (take_kv_events)."""
        self.scheduler_config = scheduler_config
        self.max_loras = max_loras
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = (
            scheduler_config.long_prefill_token_threshold if self.enable_chunked_prefill else 0
        )
        self.policy = scheduler_config.policy
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            self.block_size,
            self.max_model_len,
            cache_config.enable_prefix_caching,
            sliding_window=cache_config.sliding_window,
            kv_cache_groups=cache_config.kv_cache_groups,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_host_blocks=cache_config.num_host_blocks,
            host_block_bytes=cache_config.host_block_bytes,
            kv_events=kv_events,
        )
        # The host KV tier under the prefix cache (None: off).
        self.host_kv_tier = self.kv_cache_manager.block_pool.host_tier
        pool_tokens = self.kv_cache_manager.max_request_tokens
        # A request may grow only as long as the whole pool holds; past that it could only
        # preempt itself forever, so it is finished as length-capped there instead.
        self.max_request_len = min(self.max_model_len, pool_tokens)
        if pool_tokens < self.max_model_len:
            logger.warning(
                "The KV cache holds %d tokens (%d blocks of %d), fewer than max_model_len=%d: "
                "requests are length-capped at %d tokens.",
                pool_tokens,
                num_blocks - 1,
                self.block_size,
                self.max_model_len,
                pool_tokens,
            )
        self.requests: dict[str, Request] = {}
        # A multimodal model: how a step may cover its images (xlm.core.step_plan);
        # None: a text model.
        self.image_rule: ImageRule | None = None
        self.waiting = create_request_queue(self.policy)
        # Scheduling order: admission order (fcfs) or (priority, arrival) (priority);
        # the last one is the one preempted.
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        # Constraints (xlm.structured_output.manager); None: constrained requests refused.
        self.structured_output_manager = structured_output_manager
        # Outputs of requests finished inside schedule() (a grammar that failed to compile),
        # handed out by the next update_from_output.
        self._early_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        # Speculative decoding counters (SchedulerStats.spec_*).
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.num_steps = 0
        self.step_num_scheduled_tokens = 0
        self.total_num_scheduled_tokens = 0

    # ---- admission and aborts -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError if it is malformed or could never fit."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in the scheduler")
        check_new_request(request, self.max_model_len, self.kv_cache_manager, self.max_loras)
        constraint = getattr(request.sampling_params, "structured_outputs", None)
        if constraint is not None:
            if self.structured_output_manager is None:
                raise ValueError(
                    f"request {request.request_id!r} has structured_outputs but this engine "
                    "has no structured output manager"
                )
            request.structured_output_request = self.structured_output_manager.init_request(
                constraint, request.prompt_token_ids
            )
            request.host_tokens_only = True  # its bitmask needs the grammar's latest token
        request.status = _WAITING
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (aborts, stop strings); unknown ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status={status!r} is invalid: must be a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        running, waiting = [], []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            (running if request.status == _RUNNING else waiting).append(request)
            request.status = status
            self._free_request(request)
        if running:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if waiting:
            self.waiting.remove_requests(waiting)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their KV cache slots."""
        step = StepPlan(self.max_num_batched_tokens)
        self._schedule_running(step)
        # Then waiting requests, unless this step had to preempt.
        if not step.preempted_req_ids:
            self._schedule_waiting(step)
        return self._finish_schedule(step)

    def _schedule_running(self, step: StepPlan) -> None:
        """Running requests first, in order; when blocks run out, preempt from the end."""
        allocate_slots = self.kv_cache_manager.allocate_slots
        threshold = self.long_prefill_token_threshold
        num_scheduled_tokens, scheduled = step.num_scheduled_tokens, step.scheduled
        preempted_req_ids = step.preempted_req_ids
        token_budget = step.token_budget
        running = self.running
        i = 0
        while i < len(running) and token_budget > 0:
            request = running[i]
            placeholders = request.num_output_placeholders
            if placeholders and self._waits_for_tokens_in_flight(request):
                i += 1
                continue
            num_new = len(request.all_token_ids) + placeholders - request.num_computed_tokens
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > token_budget:
                num_new = token_budget
            if request.mm_features:
                start = request.num_computed_tokens
                num_new = step.fit_images(request, start, num_new, self.image_rule)
                if num_new == 0:  # its next image waits for the encoder cache
                    i += 1
                    continue
            assert num_new > 0, f"{request} is running with nothing to compute"
            spec = request.spec_token_ids
            if spec:
                request.spec_token_ids = []
                spec = trim_proposals(request, spec, num_new, token_budget, self.max_request_len)
                num_new += len(spec)
            while True:
                new_block_ids = allocate_slots(request, num_new)
                if new_block_ids is not None:
                    break
                if spec:  # no room for the proposals: the one known token first
                    num_new -= len(spec)
                    spec = []
                    continue
                victim = running.pop()
                self._preempt(victim)
                preempted_req_ids.add(victim.request_id)
                if victim is request:
                    break
            if new_block_ids is None:
                break
            req_id = request.request_id
            num_scheduled_tokens[req_id] = num_new
            token_budget -= num_new
            scheduled.append(request)
            step.add_cached(req_id, False, new_block_ids, request.num_computed_tokens, [])
            if spec:
                step.spec_tokens[req_id] = spec
            i += 1
        step.token_budget = token_budget

    def _schedule_waiting(self, step: StepPlan) -> None:
        """Admit waiting requests while the budget, the row cap and the blocks allow."""
        kv = self.kv_cache_manager
        allocate_slots = kv.allocate_slots
        threshold = self.long_prefill_token_threshold
        num_scheduled_tokens, scheduled = step.num_scheduled_tokens, step.scheduled
        token_budget = step.token_budget
        running = self.running
        waiting = self.waiting
        chunked = self.enable_chunked_prefill
        # Requests whose grammar still compiles step aside; they keep their place. So do
        # those whose LoRA adapter would be one more than the device's slots.
        skipped: list[Request] = []
        adapters = self._running_adapters()
        while waiting and token_budget > 0 and len(running) < self.max_num_seqs:
            request = waiting.peek_request()
            constraint = request.structured_output_request
            if constraint is not None and not constraint.is_ready():
                skipped.append(waiting.pop_request())
                continue
            lora = request.lora_request
            if lora is not None and lora.lora_int_id not in adapters:
                if len(adapters) >= self.max_loras:
                    skipped.append(waiting.pop_request())
                    continue
            if constraint is not None and constraint.error is not None:
                waiting.pop_request()
                self._fail_request(request, constraint.error)
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            # Blocks past the device hit found in the host tier: copied in, not computed.
            host_hit = kv.find_host_blocks(request, num_hit)
            num_loaded = 0 if host_hit is None else host_hit.num_blocks * self.block_size
            num_new = request.num_tokens - num_hit - num_loaded
            # A pooling request is pooled from one step's hidden states: never chunked.
            whole = not chunked or request.pooling_params is not None
            if whole and num_new > token_budget:
                break  # scheduled whole or not at all; head of line waits
            if threshold and num_new > threshold and request.pooling_params is None:
                num_new = threshold
            if num_new > token_budget:
                num_new = token_budget
            if request.mm_features:
                start = num_hit + num_loaded
                num_new = step.fit_images(request, start, num_new, self.image_rule)
                if num_new == 0:
                    break  # head of line waits for the encoder cache
            if host_hit is not None:
                hit_blocks = kv.extend_hit(hit_blocks, host_hit)
            new_block_ids = allocate_slots(request, num_loaded + num_new, num_hit, hit_blocks)
            if new_block_ids is None:
                break  # head of line waits for blocks
            if host_hit is not None:
                kv.load_host_blocks(request, num_hit, host_hit, new_block_ids)
            waiting.pop_request()
            self._admit(step, request, num_hit + num_loaded)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
            scheduled.append(request)
        for request in reversed(skipped):
            waiting.prepend_request(request)
        step.token_budget = token_budget

    def _admit(self, step: StepPlan, request: Request, num_hit: int) -> None:
        """Move an allocated waiting request to running; the runner gets its whole table."""
        if self.policy == "priority":
            bisect.insort_right(self.running, request, key=_priority_key)
        else:
            self.running.append(request)
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        req_id = request.request_id
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        if request.status == _PREEMPTED:
            step.add_cached(req_id, True, block_ids, num_hit, list(request.output_token_ids))
        else:
            step.new_reqs.append(
                NewRequestData(
                    req_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    block_ids,
                    num_hit,
                    request.pooling_params,
                    request.lora_request,
                    request.mm_features,
                )
            )
        request.status = _RUNNING

    def _running_adapters(self) -> set[int]:
        """The LoRA adapter ids of the running requests."""
        if self.max_loras is None:
            return set()
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _finish_schedule(self, step: StepPlan) -> SchedulerOutput:
        """Count the scheduled tokens as computed, build the grammar bitmask and the output."""
        num_scheduled_tokens, token_budget = step.num_scheduled_tokens, step.token_budget
        # The K/V of scheduled tokens count as computed from here on.
        constrained: list[Request] = []
        for request in step.scheduled:
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]
            # Whether it samples this step: its last token (known or in flight) is computed.
            samples = (
                request.num_computed_tokens
                >= len(request.all_token_ids) + request.num_output_placeholders
            )
            if samples:
                self._on_sampling_scheduled(request)
            constraint = request.structured_output_request
            # Only a request that samples this step and is past any reasoning needs a
            # bitmask row (a constrained request has no placeholder when scheduled).
            if samples and constraint is not None and constraint.is_constraining:
                constrained.append(request)
        grammar_bitmask = None
        if constrained:
            grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                [r.structured_output_request for r in constrained]
            )

        total = self.max_num_batched_tokens - token_budget
        finished_req_ids = self.finished_req_ids
        self.finished_req_ids = set()
        self.num_steps += 1
        self.step_num_scheduled_tokens = total
        self.total_num_scheduled_tokens += total
        return SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=step.preempted_req_ids,
            structured_output_request_ids=[r.request_id for r in constrained],
            grammar_bitmask=grammar_bitmask,
            scheduled_spec_decode_tokens=step.spec_tokens,
            kv_transfers=None if self.host_kv_tier is None else self.host_kv_tier.take_transfers(),
        )

    def _on_sampling_scheduled(self, request: Request) -> None:
        """A request will sample in the step being scheduled (AsyncScheduler counts it)."""

    def _waits_for_tokens_in_flight(self, request: Request) -> bool:
        """Whether a request with tokens in flight sits this step out (never, here: the
        synchronous scheduler has none; see AsyncScheduler)."""
        return False

    def _fail_request(self, request: Request, message: str) -> None:
        """Finish a waiting request with an error (reported by the next update)."""
        request.status = _ERROR
        request.stop_reason = message
        self._free_request(request)
        self._early_outputs.append(
            EngineCoreOutput(
                request.request_id,
                [],
                "error",
                message,
                num_cached_tokens=max(0, request.num_cached_tokens),
            )
        )

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and requeue it first, to be recomputed later."""
        self.kv_cache_manager.free(request)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)
        logger.debug("Preempted %s (preemption %d)", request.request_id, request.num_preemptions)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        requests = self.requests
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        pooler_output = model_runner_output.pooler_output
        max_len = self.max_request_len
        outputs: list[EngineCoreOutput] = self._early_outputs
        self._early_outputs = []
        any_finished = False
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        proposals = model_runner_output.spec_token_ids
        for idx, (req_id, token_ids) in enumerate(
            zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids)
        ):
            request = requests.get(req_id)
            if request is None or request.is_finished:
                continue  # finished or aborted after this step was scheduled
            if spec_scheduled and req_id in spec_scheduled and token_ids:
                self._roll_back_rejected(request, len(spec_scheduled[req_id]), len(token_ids))
            if proposals is not None:
                request.spec_token_ids = proposals[idx]
            if token_ids and request.num_output_placeholders:
                request.num_output_placeholders -= len(token_ids)
            # With async scheduling a request may be preempted while its step was in flight:
            # its token still counts (the recompute after resuming includes it).
            was_preempted = request.status == _PREEMPTED
            pooled = pooler_output[idx] if pooler_output else None
            if pooled is not None:
                outputs.append(self._finish_pooled(request, pooled))
                any_finished = True
                continue
            new_prompt_logprobs = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if not token_ids:
                if new_prompt_logprobs is not None:
                    outputs.append(
                        EngineCoreOutput(
                            req_id,
                            [],
                            new_prompt_logprobs=new_prompt_logprobs,
                            num_cached_tokens=request.num_cached_tokens,
                            first_scheduled_time=request.first_scheduled_time,
                        )
                    )
                continue
            new_token_ids, stopped = append_sampled_tokens(
                request, token_ids, max_len, self.structured_output_manager
            )
            if stopped:
                any_finished = True
                if was_preempted:
                    self.waiting.remove_requests([request])
                self._free_request(request)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    request.get_finished_reason() if stopped else None,
                    request.stop_reason if stopped else None,
                    logprobs[idx] if logprobs is not None else None,
                    new_prompt_logprobs,
                    request.num_cached_tokens,
                    request.first_scheduled_time,
                )
            )
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return outputs

    def _roll_back_rejected(self, request: Request, num_proposed: int, num_tokens: int) -> None:
        """Count a verified request's accepted proposals; the rejected ones' K/V is dropped."""
        num_accepted = roll_back_rejected(request, num_proposed, num_tokens)
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_proposed
        self.spec_num_accepted_tokens += num_accepted

    def _finish_pooled(self, request: Request, pooled: Any) -> EngineCoreOutput:
        """A pooling request's prompt is computed: it ends with its vector, blocks freed."""
        request.status = _STOPPED
        self._free_request(request)
        return EngineCoreOutput(
            request.request_id,
            [],
            request.get_finished_reason(),
            num_cached_tokens=request.num_cached_tokens,
            first_scheduled_time=request.first_scheduled_time,
            pooled=pooled,
        )

    # ---- queries --------------------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    def is_waiting(self, request_id: str) -> bool:
        """Whether the request is admitted and waits to be scheduled (new or preempted)."""
        request = self.requests.get(request_id)
        return request is not None and request.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; False while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's block events since the last call ([] when not recorded)."""
        return self.kv_cache_manager.take_events()

    def make_stats(self) -> SchedulerStats:
        """A snapshot for metrics."""
        kv = self.kv_cache_manager
        host = self.host_kv_tier
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            step_num_scheduled_tokens=self.step_num_scheduled_tokens,
            total_num_scheduled_tokens=self.total_num_scheduled_tokens,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            host_kv_cache_usage=0.0 if host is None else host.usage,
            host_kv_cache_hits=0 if host is None else host.num_hit_tokens,
            host_kv_bytes_to_host=0 if host is None else host.bytes_to_host,
            host_kv_bytes_to_device=0 if host is None else host.bytes_to_device,
        )
