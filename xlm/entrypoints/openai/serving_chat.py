"""POST /v1/chat/completions: chat messages through the chat template to a reply."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from xlm.engine.exceptions import RequestAbortedError
from xlm.entrypoints.openai.chat_output import ChatOutputParser, make_chat_output_parser
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
    OpenAIError,
    ServingContext,
    make_usage,
    raise_if_failed,
    sse_stream,
    token_text,
    top_entries,
    usage_options,
)
from xlm.entrypoints.openai.tool_parsers import get_tool_parser
from xlm.logger import init_logger
from xlm.multimodal.chat import extract_images
from xlm.reasoning import get_reasoning_parser
from xlm.tokenizer import apply_chat_template

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
        if isinstance(content, list) and any(_is_image(p) for p in content):
            content = _image_content(content, i)
        elif isinstance(content, list):
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
        if role == "assistant" and message.get("tool_calls"):
            normalized["tool_calls"] = _template_tool_calls(message["tool_calls"], i)
        out.append(normalized)
    return out


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def _image_content(content: list[Any], i: int) -> list[dict[str, Any]]:
    """Text and image parts as the chat template reads them (images already extracted:
    xlm.multimodal.chat)."""
    parts = []
    for j, part in enumerate(content):
        if _is_image(part):
            parts.append({"type": "image"})
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise OpenAIError(
                f"messages[{i}].content[{j}] of type {kind!r} is not supported: text and "
                "image_url parts",
                param="messages",
            )
    return parts


def _template_tool_calls(tool_calls: Any, i: int) -> list[Any]:
    """An assistant message's tool_calls with JSON-text arguments as objects: chat templates
    (Qwen, Hermes, Llama) render ``arguments`` with ``tojson``."""
    if not isinstance(tool_calls, list):
        raise OpenAIError(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise OpenAIError(
                f"messages[{i}].tool_calls entries need function.name", param="messages"
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # the template shows it as text
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


class OpenAIServingChat:
    """Handler of the chat completions endpoint."""

    def __init__(
        self,
        ctx: ServingContext,
        chat_template: str | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
    ) -> None:
        self.ctx = ctx
        self.chat_template = chat_template
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice

    def output_parser(self, request: ChatCompletionRequest) -> ChatOutputParser:
        """A fresh parser for one choice (reasoning split, tool calls)."""
        tool_parser = self.tool_parser if self.enable_auto_tool_choice else None
        return make_chat_output_parser(request, self.reasoning_parser, tool_parser)

    def render(self, request: ChatCompletionRequest) -> tuple[list[int], list[Any]]:
        """Token ids of the templated conversation, and its images (loaded here: a
        blocking call, off the event loop)."""
        processor = self.ctx.engine.processor
        messages, images = extract_images(
            request.messages, processor.media_policy, processor.mm_processor is not None
        )
        messages = normalize_messages(messages)
        try:
            ids = apply_chat_template(
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
        return ids, images

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """Validate, submit and answer (a response, or an SSE stream when stream=true)."""
        ctx = self.ctx
        lora = ctx.check_model(request.model)
        ctx.check_limits(request)
        if request.chat_template is not None and not ctx.trust_request_chat_template:
            raise OpenAIError(
                "chat_template in a request is refused: the server was not started with "
                "--trust-request-chat-template",
                param="chat_template",
            )
        if request.tool_choice == "auto" and request.tools and not self.enable_auto_tool_choice:
            raise OpenAIError(
                'tool_choice="auto" needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        prompt_ids, images = await ctx.run_blocking(self.render, request)
        if not prompt_ids:
            raise OpenAIError("the rendered chat prompt is empty", param="messages")
        request_id = f"chatcmpl-{request.request_id or random_uuid()}"
        core_request = ctx.process_inputs(
            request_id,
            prompt_ids,
            request.to_sampling_params(),
            images=images,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=lora,
            default_max_tokens=ctx.max_model_len,  # chat has no default: the room left
        )
        if ctx.enable_log_requests:
            logger.info(
                "Received request %s: %d prompt tokens, %s",
                request_id,
                len(core_request.prompt_token_ids),
                core_request.sampling_params,
            )
        generator = ctx.engine.generate(core_request, None, request_id)
        # Usage counts the prompt as the model sees it: image placeholders expanded.
        num_prompt = len(core_request.prompt_token_ids)
        run = _ChatRun(ctx, request, request_id, num_prompt, generator, ctx.response_model(lora))
        run.parsers = [self.output_parser(request) for _ in range(request.n)]
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
        model_name: str,
    ) -> None:
        self.ctx = ctx
        self.model_name = model_name  # the response's model: the adapter's name, if one
        self.request = request
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.generator = generator
        self.created = int(time.time())
        self.num_cached = 0  # prompt tokens served from the prefix cache
        self.tokenizer = ctx.engine.get_tokenizer()
        self.parsers: list[ChatOutputParser] = []
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
        choices = []
        for i in range(n):
            reasoning, content, tool_calls = self.parsers[i].parse(texts[i])
            if self.echo:
                content = self.echo + (content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=i,
                    message=ChatMessage(
                        role="assistant",
                        content=content,
                        reasoning_content=reasoning,
                        tool_calls=tool_calls,
                    ),
                    logprobs=self._logprobs(token_ids[i], logprobs[i])
                    if self.request.logprobs
                    else None,
                    finish_reason=_finish_reason(finish[i], bool(tool_calls)),
                    stop_reason=stop[i],
                )
            )
        usage = make_usage(self.num_prompt_tokens, sum(len(t) for t in token_ids), self.num_cached)
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage,
        )

    def _chunk(
        self, choices: list[ChatCompletionResponseStreamChoice], usage: Any = None
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage,
        )

    def stream(self) -> AsyncIterator[str]:
        """Server-sent events: the role first, then content deltas, usage, [DONE]."""
        n = self.request.n
        include_usage, continuous = usage_options(self.request)
        num_tokens = [0] * n
        finished = [False] * n

        def usage() -> ChatCompletionStreamResponse:
            return self._chunk(
                [], usage=make_usage(self.num_prompt_tokens, sum(num_tokens), self.num_cached)
            )

        def aborted() -> list[ChatCompletionStreamResponse]:
            return [
                self._chunk(
                    [
                        ChatCompletionResponseStreamChoice(
                            index=i, delta=DeltaMessage(), logprobs=None, finish_reason="abort"
                        )
                    ]
                )
                for i in range(n)
                if not finished[i]
            ]

        return sse_stream(
            self._stream_chunks(num_tokens, finished, include_usage and continuous),
            usage if include_usage else None,
            aborted,
            cleanup=self.generator.aclose,
        )

    async def _stream_chunks(
        self, num_tokens: list[int], finished: list[bool], continuous_usage: bool
    ) -> AsyncIterator[ChatCompletionStreamResponse]:
        for i in range(self.request.n):
            first = DeltaMessage(role="assistant", content=self.echo)
            yield self._chunk(
                [
                    ChatCompletionResponseStreamChoice(
                        index=i, delta=first, logprobs=None, finish_reason=None
                    )
                ]
            )
        async for output in self.generator:
            self.num_cached = output.num_cached_tokens or self.num_cached
            for c in output.outputs:
                num_tokens[c.index] += len(c.token_ids)
                raise_if_failed(c)
                final = c.finish_reason is not None
                parser = self.parsers[c.index]
                reasoning, content, tool_calls = parser.add(c.text, final)
                if not (reasoning or content or tool_calls) and not final:
                    continue
                finished[c.index] = final
                delta = DeltaMessage(
                    reasoning_content=reasoning, content=content, tool_calls=tool_calls or None
                )
                logprobs = (
                    self._logprobs(c.token_ids, c.logprobs or []) if self.request.logprobs else None
                )
                choice = ChatCompletionResponseStreamChoice(
                    index=c.index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=_finish_reason(c.finish_reason, parser.has_tool_calls),
                    stop_reason=c.stop_reason,
                )
                usage = None
                if continuous_usage:
                    usage = make_usage(self.num_prompt_tokens, sum(num_tokens), self.num_cached)
                yield self._chunk([choice], usage=usage)


def _finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """ "tool_calls" when a reply that stopped normally carries tool calls."""
    return "tool_calls" if has_tool_calls and reason == "stop" else reason
