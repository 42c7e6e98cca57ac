"""Shared parts of the OpenAI handlers: model names, errors, prompts, lengths, logprobs."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from xlm.engine.exceptions import EngineDeadError, RequestAbortedError
from xlm.engine.messages import EngineCoreRequest
from xlm.entrypoints.openai.limits import RequestLimits, check_request_limits
from xlm.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    RequestValidationError,
    UsageInfo,
)
from xlm.logger import init_logger
from xlm.lora.request import LoRARequest
from xlm.multimodal.chat import with_images
from xlm.sampling_params import SamplingParams

logger = init_logger(__name__)


class OpenAIError(Exception):
    """An error to answer with OpenAI's error shape and an HTTP status."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param
        self.code = code

    def to_response(self) -> ErrorResponse:
        """The error body."""
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=self.err_type, param=self.param, code=self.code
            )
        )


def error_from_validation(errors: Sequence[Any]) -> OpenAIError:
    """A 400 from pydantic's errors: a validator's own RequestValidationError as it is (its
    parameter and message), else the first errors' places and messages."""
    for err in errors:
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, RequestValidationError):
            return OpenAIError(str(cause), param=cause.param, code=cause.code)
    parts, param = [], None
    for err in list(errors)[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        msg = err.get("msg", "invalid")
        parts.append(f"{where}: {msg}" if where else msg)
    return OpenAIError("; ".join(parts) or "invalid request", param=param)


def error_from_exception(e: BaseException) -> OpenAIError:
    """Map an exception from validation or the engine to an OpenAIError."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, RequestValidationError):
        return OpenAIError(str(e), param=e.param, code=e.code)
    if isinstance(e, ValueError | TypeError | OverflowError):
        return OpenAIError(str(e))
    # A server-side failure: its text (tracebacks, paths) goes to the log under an id; the
    # client gets only the id to quote.
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    if isinstance(e, EngineDeadError):
        logger.error("Request failed, error id %s: the engine is dead: %s", error_id, e)
        return OpenAIError(
            f"The engine is dead (error id {error_id}; see the server log)",
            HTTPStatus.INTERNAL_SERVER_ERROR,
            "server_error",
            code="engine_dead",
        )
    logger.error("Request failed, error id %s", error_id, exc_info=e)
    return OpenAIError(
        f"Internal server error (error id {error_id}; see the server log)",
        HTTPStatus.INTERNAL_SERVER_ERROR,
        "server_error",
    )


def sse(data: Any) -> str:
    """One server-sent event carrying JSON (or a pydantic model)."""
    if hasattr(data, "model_dump_json"):
        return f"data: {data.model_dump_json()}\n\n"
    return f"data: {json.dumps(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_options(request: Any) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a streaming request's stream_options."""
    options = request.stream_options
    return bool(options and options.include_usage), bool(options and options.continuous_usage_stats)


def raise_if_failed(completion: Any) -> None:
    """A 500 for an output the engine failed (finish_reason "error")."""
    if completion.finish_reason == "error":
        raise OpenAIError(
            f"The engine failed the request: {completion.stop_reason}",
            status=500,
            err_type="server_error",
        )


async def sse_stream(
    chunks: AsyncIterator[Any],
    final_chunk: Callable[[], Any] | None,
    abort_chunks: Callable[[], Iterable[Any]],
    cleanup: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[str]:
    """The SSE envelope the streaming endpoints share.

    Each of `chunks` as an event, then `final_chunk()` (the usage chunk) if given; on an
    abort, `abort_chunks()` (finish_reason "abort" for the unfinished choices); on any
    other error, one OpenAI error event; `cleanup()` in every case; `[DONE]` last.
    """
    try:
        async for chunk in chunks:
            yield sse(chunk)
        if final_chunk is not None:
            yield sse(final_chunk())
    except RequestAbortedError:
        for chunk in abort_chunks():
            yield sse(chunk)
    except Exception as e:
        yield sse(error_from_exception(e).to_response())
    finally:
        if cleanup is not None:
            await cleanup()
    yield SSE_DONE


@dataclass
class ServingContext:
    """What every handler needs: the engine, model names and limits."""

    engine: Any
    served_model_names: list[str]
    max_model_len: int
    enable_log_requests: bool = False
    # Tokens the whole KV cache holds (None: unknown); a longer prompt can never run.
    kv_cache_tokens: int | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Whether a request may bring its own chat_template (--trust-request-chat-template).
    trust_request_chat_template: bool = False
    # Tokenization and template rendering run here, off the event loop.
    executor: Executor | None = None
    # LoRA adapters a request's model may name (kept by OpenAIServingModels).
    lora_requests: dict[str, LoRARequest] = field(default_factory=dict)

    def check_limits(self, request: Any) -> None:
        """400 for a field over the server's caps (before any tokenization)."""
        check_request_limits(request, self.limits)

    async def run_blocking(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the tokenizer thread pool, so long prompts do not stall streams."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, fn, *args)

    @property
    def model_name(self) -> str:
        """The first served name (reported in responses)."""
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model names (None: the base model); 404 unless model is
        unset, a served name or an adapter's name."""
        if model is None or model in self.served_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise OpenAIError(
                f"The model `{model}` does not exist.",
                HTTPStatus.NOT_FOUND,
                "NotFoundError",
                param="model",
                code="model_not_found",
            )
        return lora

    def response_model(self, lora: LoRARequest | None) -> str:
        """The model a response reports: the adapter's name, else the first served name."""
        return self.model_name if lora is None else lora.lora_name

    def tokenize_prompts(self, prompt: Any, add_special_tokens: bool) -> list[list[int]]:
        """A completion's prompt field as token-id lists (one per prompt).

        Token ids are checked against the model (vocabulary, empty) by `process_inputs`.
        """
        tokenizer = self.engine.get_tokenizer()
        if isinstance(prompt, str):
            prompts: Sequence[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        else:
            prompts = prompt
        if not prompts:
            raise OpenAIError("prompt must not be empty", param="prompt")
        result = []
        for item in prompts:
            if isinstance(item, str):
                if item == "":
                    raise OpenAIError("prompt must not be an empty string", param="prompt")
                ids = list(tokenizer.encode(item, add_special_tokens=add_special_tokens))
            else:
                ids = list(item)
            result.append(ids)
        return result

    def process_inputs(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None,
        text: str | None = None,
        images: list[Any] | None = None,
        **kwargs: Any,
    ) -> EngineCoreRequest:
        """The engine request of one prompt; 400 for a prompt or parameters the model cannot
        serve.

        The rules are the engine's own (`Processor.process_inputs`, which LLM uses too), run
        here once, before any output is sent (a streamed request gets its 400 too); AsyncLLM
        takes the request as it is.
        """
        if self.kv_cache_tokens is not None and len(prompt_ids) > self.kv_cache_tokens:
            raise OpenAIError(
                f"The prompt has {len(prompt_ids)} tokens but the server's KV cache holds "
                f"only {self.kv_cache_tokens} tokens, so it can never run. Please shorten "
                "the prompt.",
                param="prompt",
                code="context_length_exceeded",
            )
        prompt = with_images(engine_prompt(prompt_ids, text), images or [])
        return self.engine.processor.process_inputs(request_id, prompt, params, **kwargs)


def engine_prompt(token_ids: list[int], text: str | None = None) -> dict[str, Any]:
    """The prompt form handed to AsyncLLM.generate: token ids (plus the text if known)."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if text is not None:
        prompt["prompt"] = text
    return prompt


def make_usage(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None
) -> UsageInfo:
    """UsageInfo from counts."""
    usage = UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )
    if num_cached_tokens is not None:  # prompt tokens the prefix cache supplied
        usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=max(num_cached_tokens, 0))
    return usage


def token_text(tokenizer: Any, token_id: int, logprob: Any) -> str:
    """Text of one token for logprobs (the detokenizer's, else decoded alone)."""
    text = getattr(logprob, "decoded_token", None)
    if text is None:
        text = tokenizer.decode([token_id])
    return text


def top_entries(entries: dict[int, Any], sampled: int, k: int) -> list[tuple[int, Any]]:
    """The top-k of a position's logprob dict, by rank (the sampled token if it is among them)."""
    ranked = sorted(
        entries.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30
    )
    return ranked[:k]


async def merge_async_iterators(
    *iterators: AsyncIterator[Any],
) -> AsyncIterator[tuple[int, Any]]:
    """Interleave async iterators as (index, item); closes all of them on exit."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _aclose(iterators[0])
        return
    loop = asyncio.get_running_loop()
    pending = {loop.create_task(_anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                item = task.result()
                if item is _STOP:
                    continue
                pending[loop.create_task(_anext(iterators[index]))] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        if pending:  # let cancelled generators unwind (they abort their requests)
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await _aclose(it)


_STOP = object()


async def _anext(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return _STOP


async def _aclose(it: Any) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except (RuntimeError, asyncio.CancelledError):
            pass
