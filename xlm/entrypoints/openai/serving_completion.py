"""POST /v1/completions: prompts (text or token ids, one or many) to completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from xlm.engine.exceptions import RequestAbortedError
from xlm.entrypoints.openai.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    random_uuid,
)
from xlm.entrypoints.openai.serving_engine import (
    OpenAIError,
    ServingContext,
    make_usage,
    merge_async_iterators,
    raise_if_failed,
    sse_stream,
    token_text,
    top_entries,
    usage_options,
)
from xlm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class _Choice:
    """A choice being accumulated from DELTA outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServingCompletion:
    """Handler of the completions endpoint."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | AsyncIterator[str]:
        """Validate, submit and answer (a response, or an SSE stream when stream=true)."""
        ctx = self.ctx
        lora = ctx.check_model(request.model)
        ctx.check_limits(request)
        prompts = await ctx.run_blocking(
            ctx.tokenize_prompts, request.prompt, request.add_special_tokens
        )
        tokenizer = ctx.engine.get_tokenizer()
        texts = [request.prompt if isinstance(request.prompt, str) else None for _ in prompts]
        if (
            isinstance(request.prompt, list)
            and request.prompt
            and isinstance(request.prompt[0], str)
        ):
            texts = list(request.prompt)
        params = request.to_sampling_params()
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = request.logprobs
        request_id = f"cmpl-{request.request_id or random_uuid()}"
        core_requests = [
            ctx.process_inputs(
                f"{request_id}-{i}",
                ids,
                params,
                text,
                priority=request.priority,
                cache_salt=request.cache_salt,
                lora_request=lora,
                default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS,
            )
            for i, (ids, text) in enumerate(zip(prompts, texts))
        ]
        if ctx.enable_log_requests:
            logger.info(
                "Received request %s: %d prompt(s), %s",
                request_id,
                len(prompts),
                core_requests[0].sampling_params,
            )
        generators = [ctx.engine.generate(r, None, r.request_id) for r in core_requests]
        echo_texts = [
            (text if text is not None else tokenizer.decode(ids)) if request.echo else ""
            for ids, text in zip(prompts, texts)
        ]
        run = _Run(
            ctx, request, request_id, prompts, echo_texts, generators, ctx.response_model(lora)
        )
        if request.stream:
            return run.stream()
        return await run.full()


class _Run:
    """One completion request in flight."""

    def __init__(
        self,
        ctx: ServingContext,
        request: CompletionRequest,
        request_id: str,
        prompts: list[list[int]],
        echo_texts: list[str],
        generators: list[Any],
        model_name: str,
    ) -> None:
        self.ctx = ctx
        self.request = request
        self.request_id = request_id
        self.prompts = prompts
        self.echo_texts = echo_texts
        self.generators = generators
        self.n = request.n
        self.created = int(time.time())
        self.tokenizer = ctx.engine.get_tokenizer()
        self.model_name = model_name  # the response's model: the adapter's name, if one
        self.num_cached = [0] * len(prompts)
        self.prompt_logprobs: list[list[Any]] = [[] for _ in prompts]

    def _logprobs(
        self, choice: _Choice, token_ids: list[int], entries: list[Any], offset: int
    ) -> CompletionLogProbs:
        out = CompletionLogProbs()
        k = self.request.logprobs or 0
        for token_id, position in zip(token_ids, entries):
            lp = position.get(token_id) if position else None
            tok = token_text(self.tokenizer, token_id, lp)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            top = {
                token_text(self.tokenizer, t, e): e.logprob
                for t, e in top_entries(position or {}, token_id, k)
            }
            if lp is not None:
                top.setdefault(tok, lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(tok)
        return out

    def _echo_logprobs(self, prompt_idx: int, completion: CompletionLogProbs) -> CompletionLogProbs:
        """Prompt-token logprobs (the first is None) before the completion's, as OpenAI echoes."""
        out = CompletionLogProbs()
        entries = self.prompt_logprobs[prompt_idx]
        offset = 0
        k = self.request.logprobs or 0
        for i, token_id in enumerate(self.prompts[prompt_idx]):
            position = entries[i] if i < len(entries) else None
            lp = position.get(token_id) if position else None
            tok = token_text(self.tokenizer, token_id, lp)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            top = None
            if position:
                top = {
                    token_text(self.tokenizer, t, e): e.logprob
                    for t, e in top_entries(position, token_id, k)
                }
                if lp is not None:
                    top.setdefault(tok, lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(tok)
        out.tokens += completion.tokens
        out.token_logprobs += completion.token_logprobs
        out.top_logprobs += completion.top_logprobs
        out.text_offset += completion.text_offset
        return out

    def _usage(self, choices: dict[int, _Choice]) -> Any:
        num_prompt = sum(len(p) for p in self.prompts)
        num_completion = sum(len(c.token_ids) for c in choices.values())
        return make_usage(num_prompt, num_completion, sum(self.num_cached))

    async def full(self) -> CompletionResponse:
        """Collect every output, then build one response."""
        choices = {i: _Choice() for i in range(len(self.prompts) * self.n)}
        try:
            async for prompt_idx, output in merge_async_iterators(*self.generators):
                self._accumulate(choices, prompt_idx, output)
        except RequestAbortedError:
            for choice in choices.values():
                choice.finish_reason = choice.finish_reason or "abort"
        for choice in choices.values():
            if choice.finish_reason == "error":
                raise OpenAIError(
                    f"The engine failed the request: {choice.stop_reason}",
                    status=500,
                    err_type="server_error",
                )
        response_choices = []
        for idx, choice in choices.items():
            prompt_idx = idx // self.n
            text = self.echo_texts[prompt_idx] + choice.text
            logprobs = None
            if self.request.logprobs is not None:
                logprobs = self._logprobs(
                    choice, choice.token_ids, choice.logprobs, len(self.echo_texts[prompt_idx])
                )
                if self.request.echo:
                    logprobs = self._echo_logprobs(prompt_idx, logprobs)
            response_choices.append(
                CompletionResponseChoice(
                    index=idx,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=response_choices,
            usage=self._usage(choices),
        )

    def _accumulate(self, choices: dict[int, _Choice], prompt_idx: int, output: Any) -> None:
        if output.num_cached_tokens:
            self.num_cached[prompt_idx] = output.num_cached_tokens
        if output.prompt_logprobs:
            self.prompt_logprobs[prompt_idx].extend(output.prompt_logprobs)
        for completion in output.outputs:
            choice = choices[prompt_idx * self.n + completion.index]
            choice.text += completion.text
            choice.token_ids.extend(completion.token_ids)
            if completion.logprobs:
                choice.logprobs.extend(completion.logprobs)
            choice.finish_reason = completion.finish_reason
            choice.stop_reason = completion.stop_reason

    def stream(self) -> AsyncIterator[str]:
        """Server-sent events: one chunk per new text, usage if asked, then [DONE]."""
        choices = {i: _Choice() for i in range(len(self.prompts) * self.n)}
        include_usage, continuous = usage_options(self.request)

        def usage() -> CompletionStreamResponse:
            return self._stream_response([], usage=self._usage(choices))

        def aborted() -> list[CompletionStreamResponse]:
            return [
                self._stream_response(
                    [
                        CompletionResponseStreamChoice(
                            index=idx, text="", logprobs=None, finish_reason="abort"
                        )
                    ]
                )
                for idx, choice in choices.items()
                if choice.finish_reason is None
            ]

        return sse_stream(
            self._stream_chunks(choices, include_usage and continuous),
            usage if include_usage else None,
            aborted,
        )

    def _stream_response(self, choices: list[Any], usage: Any = None) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage,
        )

    async def _stream_chunks(
        self, choices: dict[int, _Choice], continuous_usage: bool
    ) -> AsyncIterator[CompletionStreamResponse]:
        echoed: set[int] = set()
        async for prompt_idx, output in merge_async_iterators(*self.generators):
            for completion in output.outputs:
                idx = prompt_idx * self.n + completion.index
                choice = choices[idx]
                offset = len(choice.text)
                text = completion.text
                choice.text += text
                choice.token_ids.extend(completion.token_ids)
                choice.finish_reason = completion.finish_reason
                raise_if_failed(completion)
                if self.request.echo and idx not in echoed:
                    echoed.add(idx)
                    text = self.echo_texts[prompt_idx] + text
                if not text and completion.finish_reason is None:
                    continue
                logprobs = None
                if self.request.logprobs is not None:
                    logprobs = self._logprobs(
                        choice, completion.token_ids, completion.logprobs or [], offset
                    )
                stream_choice = CompletionResponseStreamChoice(
                    index=idx,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                usage = self._usage(choices) if continuous_usage else None
                yield self._stream_response([stream_choice], usage=usage)
