"""Turns the engine core's per-step token ids into RequestOutputs (text, logprobs, stops)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xlm.engine.detokenizer import IncrementalDetokenizer, TokenizerInfo
from xlm.engine.messages import EngineCoreRequest
from xlm.engine.parallel_sampling import ParentRequest, fan_out
from xlm.logger import init_logger
from xlm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from xlm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


@dataclass
class OutputProcessorResult:
    """RequestOutputs to hand out, and ids the core must abort (stop strings matched)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestState:
    """Host-side state of one (child) request while it runs."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        info: TokenizerInfo | None,
        parent: ParentRequest | None,
        index: int,
        queue: Any,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.info = info
        self.parent = parent
        self.index = index
        self.queue = queue
        self.detokenizer = IncrementalDetokenizer(info, prompt_token_ids, params)
        self.output_token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self._sent_tokens = 0
        self._sent_logprobs = 0
        self._sent_prompt_logprobs = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0

    def _logprob_dicts(self, lists: Any, num: int) -> list[dict[int, Logprob]]:
        decode = self.info.decode_token if self.info is not None else (lambda _: None)
        dicts = []
        for ids, lps, rank in zip(
            lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks
        ):
            d = {ids[0]: Logprob(lps[0], rank, decode(ids[0]))}
            for k in range(1, min(num, len(ids) - 1) + 1):
                d.setdefault(ids[k], Logprob(lps[k], k, decode(ids[k])))
            dicts.append(d)
        return dicts

    def add_logprobs(self, new_logprobs: Any, new_prompt_logprobs: Any) -> None:
        """Convert the core's logprob lists into Logprob dicts."""
        if new_logprobs is not None and self.logprobs is not None:
            dicts = self._logprob_dicts(new_logprobs, self.params.logprobs or 0)
            self.logprobs.extend(dicts)
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += sum(row[0] for row in new_logprobs.logprobs)
        if new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            num = self.params.prompt_logprobs or 0
            self.prompt_logprobs.extend(self._logprob_dicts(new_prompt_logprobs, num))

    def make_completion(self, finish_reason: str | None, stop_reason: Any) -> CompletionOutput:
        """This step's CompletionOutput (new parts only in DELTA mode)."""
        delta = self.params.output_kind == RequestOutputKind.DELTA
        finished = finish_reason is not None
        text = self.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = self.output_token_ids[self._sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self._sent_logprobs :]
        else:
            token_ids = list(self.output_token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        self._sent_tokens = len(self.output_token_ids)
        self._sent_logprobs = len(self.logprobs or [])
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """Prompt logprobs to send: all so far, or (DELTA) the ones not yet sent."""
        if self.prompt_logprobs is None:
            return None
        if self.params.output_kind != RequestOutputKind.DELTA:
            return list(self.prompt_logprobs)
        new = self.prompt_logprobs[self._sent_prompt_logprobs :]
        self._sent_prompt_logprobs = len(self.prompt_logprobs)
        return new or None


class OutputProcessor:
    """Detokenizes, applies stop strings and builds RequestOutputs, step by step."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.info = TokenizerInfo(tokenizer) if tokenizer is not None else None
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        """Number of (child) requests still running."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still running."""
        return bool(self.request_states)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: Any = None,
    ) -> None:
        """Track a request (a child of ``parent_req`` with index ``request_index`` if n>1)."""
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already running")
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req
        self.request_states[request_id] = RequestState(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            arrival_time,
            self.info,
            parent_req,
            request_index,
            queue,
        )

    def add_engine_request(
        self, request: EngineCoreRequest, queue: Any = None
    ) -> list[EngineCoreRequest]:
        """Track a processed request (its n children when n > 1); returns what the core runs."""
        core_requests = []
        for child, parent, index in fan_out(request):
            self.add_request(
                child.request_id,
                child.prompt,
                child.prompt_token_ids,
                child.sampling_params,
                child.arrival_time,
                parent,
                index,
                queue,
            )
            core_requests.append(child)
        return core_requests

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (parent or child ids); returns the child ids the core must abort."""
        to_abort: list[str] = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            ids = parent.child_request_ids() if parent is not None else [request_id]
            for rid in ids:
                if self.request_states.pop(rid, None) is not None:
                    to_abort.append(rid)
        return to_abort

    def process_outputs(self, outputs: list[Any], timestamp: float) -> OutputProcessorResult:
        """Consume one step of EngineCoreOutputs (duck-typed) and build RequestOutputs."""
        result = OutputProcessorResult()
        parent_steps: dict[str, tuple[ParentRequest, RequestState, list[CompletionOutput]]] = {}
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            if out.pooled is not None:  # a pooling request: its vector is its one output
                self._finish_pooled(result, state, out, timestamp)
                continue
            new_ids = list(out.new_token_ids)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            metrics = state.metrics
            scheduled = out.first_scheduled_time
            if metrics.first_scheduled_time is None and scheduled is not None:
                metrics.first_scheduled_time = scheduled
            if new_ids:
                if metrics.first_token_time is None:
                    metrics.first_token_time = timestamp
                metrics.last_token_time = timestamp
                metrics.num_generation_tokens += len(new_ids)
            if out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            state.output_token_ids.extend(new_ids)
            state.add_logprobs(out.new_logprobs, out.new_prompt_logprobs)
            # "stop" after an EOS / stop token (whose text is not output), or after a
            # structured-output grammar completed on an ordinary token (whose text is).
            stop_terminated = finish_reason == "stop" and not (
                state.params.structured_outputs is not None
                and new_ids
                and stop_reason is None
                and new_ids[-1] not in state.params.all_stop_token_ids
            )
            stop_str = state.detokenizer.update(
                new_ids, stop_terminated=stop_terminated, finished=finish_reason is not None
            )
            if stop_str is not None:
                if finish_reason is None:
                    result.reqs_to_abort.append(state.request_id)
                finish_reason, stop_reason = "stop", stop_str
            finished = finish_reason is not None
            if finished:
                metrics.finished_time = timestamp
                del self.request_states[state.request_id]
            kind = state.params.output_kind
            if state.parent is None:
                if kind == RequestOutputKind.FINAL_ONLY and not finished:
                    continue
                if kind == RequestOutputKind.DELTA and not new_ids and not finished:
                    continue
                completion = state.make_completion(finish_reason, stop_reason)
                self._emit(result, state, state.request_id, [completion], finished, metrics)
                continue
            parent = state.parent
            self._merge_metrics(parent.metrics, metrics, timestamp if finished else None)
            parent.metrics.num_generation_tokens += len(new_ids)
            entry = parent_steps.setdefault(parent.request_id, (parent, state, []))
            if new_ids or finished:
                completion = state.make_completion(finish_reason, stop_reason)
                parent.add_output(completion)
                entry[2].append(completion)
        for parent, state, completions in parent_steps.values():
            merged = parent.merged_outputs(completions)
            if not merged and not parent.finished:
                continue
            if parent.finished:
                self.parent_requests.pop(parent.request_id, None)
            self._emit(result, state, parent.request_id, merged, parent.finished, parent.metrics)
        return result

    @staticmethod
    def _merge_metrics(
        total: RequestMetrics, child: RequestMetrics, finished: float | None
    ) -> None:
        if child.first_scheduled_time is not None and (
            total.first_scheduled_time is None
            or child.first_scheduled_time < total.first_scheduled_time
        ):
            total.first_scheduled_time = child.first_scheduled_time
        if child.first_token_time is not None and total.first_token_time is None:
            total.first_token_time = child.first_token_time
        total.last_token_time = child.last_token_time or total.last_token_time
        if finished is not None:
            total.finished_time = finished

    def _finish_pooled(
        self, result: OutputProcessorResult, state: RequestState, out: Any, timestamp: float
    ) -> None:
        del self.request_states[state.request_id]
        metrics = state.metrics
        metrics.first_scheduled_time = out.first_scheduled_time
        metrics.first_token_time = metrics.finished_time = timestamp
        output = PoolingRequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=PoolingOutput(np.asarray(out.pooled, dtype=np.float32)),
            metrics=metrics,
            num_cached_tokens=out.num_cached_tokens,
        )
        self._deliver(result, state, output)

    def _emit(
        self,
        result: OutputProcessorResult,
        state: RequestState,
        request_id: str,
        completions: list[CompletionOutput],
        finished: bool,
        metrics: RequestMetrics,
    ) -> None:
        output = RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.take_prompt_logprobs(),
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=state.num_cached_tokens,
        )
        self._deliver(result, state, output)

    @staticmethod
    def _deliver(result: OutputProcessorResult, state: RequestState, output: Any) -> None:
        """To the request's queue (AsyncLLM), else into this step's result (LLMEngine)."""
        if state.queue is None:
            result.request_outputs.append(output)
        elif hasattr(state.queue, "put_nowait"):
            state.queue.put_nowait(output)
        else:
            state.queue.put(output)
