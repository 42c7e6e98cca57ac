"""POST /v1/chat/completions: chat messages through the chat template to a reply."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from xlm.engine.exceptions import RequestAbortedError
from xlm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    random_uuid,
)
from xlm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    ServingContext,
    engine_prompt,
    error_from_exception,
    make_usage,
    sse,
    token_text,
    top_entries,
)
from xlm.logger import init_logger

logger = init_logger(__name__)

_ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and flatten content parts to text (400 for anything else)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise OpenAIError(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if role not in _ROLES:
            raise OpenAIError(
                f"messages[{i}].role={role!r} is invalid: allowed {list(_ROLES)}",
                param="messages",
            )
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIError(
                        f"messages[{i}].content[{j}] of type {kind!r} is not supported: "
                        "only text parts",
                        param="messages",
                    )
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise OpenAIError(
                f"messages[{i}].content must be a string or a list of text parts",
                param="messages",
            )
        if content is None and role != "assistant":
            raise OpenAIError(f"messages[{i}].content is missing", param="messages")
        normalized = {k: v for k, v in message.items() if k != "content"}
        normalized["content"] = content or ""
        out.append(normalized)
    return out


class OpenAIServingChat:
    """Handler of the chat completions endpoint."""

    def __init__(self, ctx: ServingContext, chat_template: str | None = None) -> None:
        self.ctx = ctx
        self.chat_template = chat_template

    def render(self, request: ChatCompletionRequest) -> list[int]:
        """Token ids of the templated conversation."""
        from xlm.tokenizer import apply_chat_template

        messages = normalize_messages(request.messages)
        try:
            return apply_chat_template(
                self.ctx.engine.get_tokenizer(),
                messages,
                chat_template=request.chat_template or self.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=request.tools,
                template_kwargs=request.chat_template_kwargs,
            )
        except OpenAIError:
            raise
        except Exception as e:  # template errors are the request's
            raise OpenAIError(f"Could not apply the chat template: {e}", param="messages") from e

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """Validate, submit and answer (a response, or an SSE stream when stream=true)."""
        ctx = self.ctx
        ctx.check_model(request.model)
        ctx.check_limits(request)
        if request.chat_template is not None and not ctx.trust_request_chat_template:
            raise OpenAIError(
                "chat_template in a request is refused: the server was not started with "
                "--trust-request-chat-template",
                param="chat_template",
            )
        prompt_ids = await ctx.run_blocking(self.render, request)
        if not prompt_ids:
            raise OpenAIError("the rendered chat prompt is empty", param="messages")
        requested = request.max_completion_tokens or request.max_tokens
        max_tokens = ctx.max_tokens_for(len(prompt_ids), requested)
        params = request.to_sampling_params(max_tokens, ctx.max_logprobs)
        ctx.check_sampling_vocab(params)
        request_id = f"chatcmpl-{request.request_id or random_uuid()}"
        if ctx.enable_log_requests:
            logger.info(
                "Received request %s: %d prompt tokens, %s", request_id, len(prompt_ids), params
            )
        generator = ctx.engine.generate(
            engine_prompt(prompt_ids),
            params,
            request_id,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        run = _ChatRun(ctx, request, request_id, len(prompt_ids), generator)
        if request.stream:
            return run.stream()
        return await run.full()


class _ChatRun:
    """One chat request in flight."""

    def __init__(
        self,
        ctx: ServingContext,
        request: ChatCompletionRequest,
        request_id: str,
        num_prompt_tokens: int,
        generator: Any,
    ) -> None:
        self.ctx = ctx
        self.request = request
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.generator = generator
        self.created = int(time.time())
        self.num_cached = 0  # prompt tokens served from the prefix cache
        self.tokenizer = ctx.engine.get_tokenizer()
        self.echo = ""
        if request.echo and request.messages:
            last = request.messages[-1]
            if isinstance(last.get("content"), str):
                self.echo = last["content"]

    def _logprobs(self, token_ids: list[int], entries: list[Any]) -> ChatCompletionLogProbs:
        k = self.request.top_logprobs or 0
        content = []
        for token_id, position in zip(token_ids, entries):
            lp = position.get(token_id) if position else None
            tok = token_text(self.tokenizer, token_id, lp)
            top = [
                ChatCompletionLogProb(
                    token=(t_text := token_text(self.tokenizer, t, e)),
                    logprob=max(e.logprob, -9999.0),
                    bytes=list(t_text.encode("utf-8", errors="replace")),
                )
                for t, e in top_entries(position or {}, token_id, k)
            ]
            content.append(
                ChatCompletionLogProbsContent(
                    token=tok,
                    logprob=max(lp.logprob, -9999.0) if lp is not None else -9999.0,
                    bytes=list(tok.encode("utf-8", errors="replace")),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)

    async def full(self) -> ChatCompletionResponse:
        """Collect every output, then build one response."""
        n = self.request.n
        texts = [""] * n
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[Any]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        stop: list[Any] = [None] * n
        try:
            async for output in self.generator:
                self.num_cached = output.num_cached_tokens or self.num_cached
                for c in output.outputs:
                    texts[c.index] += c.text
                    token_ids[c.index].extend(c.token_ids)
                    logprobs[c.index].extend(c.logprobs or [])
                    finish[c.index], stop[c.index] = c.finish_reason, c.stop_reason
        except RequestAbortedError:
            finish = [f or "abort" for f in finish]
        for i in range(n):
            if finish[i] == "error":
                raise OpenAIError(
                    f"The engine failed the request: {stop[i]}", status=500, err_type="server_error"
                )
        choices = [
            ChatCompletionResponseChoice(
                index=i,
                message=ChatMessage(role="assistant", content=self.echo + texts[i]),
                logprobs=self._logprobs(token_ids[i], logprobs[i])
                if self.request.logprobs
                else None,
                finish_reason=finish[i],
                stop_reason=stop[i],
            )
            for i in range(n)
        ]
        usage = make_usage(self.num_prompt_tokens, sum(len(t) for t in token_ids), self.num_cached)
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=usage,
        )

    def _chunk(self, choices: list[ChatCompletionResponseStreamChoice]) -> str:
        return sse(
            ChatCompletionStreamResponse(
                id=self.request_id,
                created=self.created,
                model=self.ctx.model_name,
                choices=choices,
            )
        )

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: the role first, then content deltas, usage, [DONE]."""
        n = self.request.n
        options = self.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        num_tokens = [0] * n
        finished = [False] * n
        try:
            for i in range(n):
                first = DeltaMessage(role="assistant", content=self.echo)
                yield self._chunk(
                    [
                        ChatCompletionResponseStreamChoice(
                            index=i,
                            delta=first,
                            logprobs=None,
                            finish_reason=None,
                        )
                    ]
                )
            async for output in self.generator:
                self.num_cached = output.num_cached_tokens or self.num_cached
                for c in output.outputs:
                    num_tokens[c.index] += len(c.token_ids)
                    if c.finish_reason == "error":
                        raise OpenAIError(
                            f"The engine failed the request: {c.stop_reason}",
                            status=500,
                            err_type="server_error",
                        )
                    if not c.text and c.finish_reason is None:
                        continue
                    finished[c.index] = c.finish_reason is not None
                    delta = DeltaMessage(content=c.text) if c.text else DeltaMessage()
                    logprobs = (
                        self._logprobs(c.token_ids, c.logprobs or [])
                        if self.request.logprobs
                        else None
                    )
                    chunk = ChatCompletionStreamResponse(
                        id=self.request_id,
                        created=self.created,
                        model=self.ctx.model_name,
                        choices=[
                            ChatCompletionResponseStreamChoice(
                                index=c.index,
                                delta=delta,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        ],
                    )
                    if include_usage and continuous:
                        chunk.usage = make_usage(
                            self.num_prompt_tokens, sum(num_tokens), self.num_cached
                        )
                    yield sse(chunk)
            if include_usage:
                yield sse(
                    ChatCompletionStreamResponse(
                        id=self.request_id,
                        created=self.created,
                        model=self.ctx.model_name,
                        choices=[],
                        usage=make_usage(self.num_prompt_tokens, sum(num_tokens), self.num_cached),
                    )
                )
        except RequestAbortedError:
            for i in range(n):
                if not finished[i]:
                    yield self._chunk(
                        [
                            ChatCompletionResponseStreamChoice(
                                index=i,
                                delta=DeltaMessage(),
                                logprobs=None,
                                finish_reason="abort",
                            )
                        ]
                    )
        except Exception as e:
            yield sse(error_from_exception(e).to_response())
        finally:
            await self.generator.aclose()
        yield SSE_DONE
