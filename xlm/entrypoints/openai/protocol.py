"""Pydantic models of the OpenAI API (completions, chat, models, errors) plus vLLM extras."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from xlm.entrypoints.openai.limits import (  # noqa: F401  (RequestValidationError re-exported)
    Int32,
    Int64,
    RequestValidationError,
    Seed,
)
from xlm.entrypoints.openai.structured import constraint_of_chat_request, constraint_of_request
from xlm.sampling_params import RequestOutputKind, SamplingParams


def random_uuid() -> str:
    """A random hex id."""
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Base of every protocol model: unknown request fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")


# ---- errors, models, usage ----------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    """The body of an OpenAI error."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class ModelPermission(OpenAIBaseModel):
    """Legacy permission record some clients expect on a model card."""

    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_view: bool = True
    organization: str = "*"
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "xlm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter (vLLM's): a name for requests' model, and the directory."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UpdateWeightsRequest(OpenAIBaseModel):
    """POST /update_weights: a checkpoint directory (or GGUF file) of the served model's
    shapes, on the server's filesystem."""

    path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter (vLLM's; its lora_int_id is accepted and unused)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class PromptTokensDetails(OpenAIBaseModel):
    """Prompt token breakdown (prefix-cache hits)."""

    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    """Token counts of a response."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class StreamOptions(OpenAIBaseModel):
    """stream_options of a streaming request."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


# ---- shared sampling fields ---------------------------------------------------------------


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completion and chat requests (OpenAI's and vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: Int32 = 1
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Int32 | None = None
    priority: Int32 = 0
    request_id: str | None = None
    cache_salt: str | None = None
    # Structured outputs (xlm.entrypoints.openai.structured maps these onto one constraint)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.cache_salt is not None and self.cache_salt == "":
            raise ValueError("cache_salt must be a non-empty string when given")
        return self

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, structured_outputs: Any = None
    ) -> SamplingParams:
        """SamplingParams from the fields the client set (unset ones keep the model's defaults;
        max_tokens None: the engine's `get_max_tokens` decides)."""
        kwargs: dict[str, Any] = {}
        if structured_outputs is not None:
            kwargs["structured_outputs"] = structured_outputs
        for name in (
            "frequency_penalty",
            "presence_penalty",
            "seed",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "prompt_logprobs",
            "allowed_token_ids",
            "bad_words",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.logit_bias is not None:
            try:
                kwargs["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise RequestValidationError(
                    "logit_bias keys must be integer token ids", "logit_bias"
                ) from None
        # DELTA for non-streamed requests too: the handler accumulates, so a request aborted
        # at shutdown can still answer with its partial text.
        kind = RequestOutputKind.DELTA
        try:
            return SamplingParams(
                n=self.n,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                output_kind=kind,
                **kwargs,
            )
        except ValueError as e:
            raise RequestValidationError.from_value_error(e) from None


# ---- completions --------------------------------------------------------------------------

# OpenAI's max_tokens for a completion that does not set it (chat has none: the room left).
DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    best_of: Int32 | None = None
    echo: bool = False
    logprobs: Int32 | None = None
    # None: DEFAULT_COMPLETION_MAX_TOKENS, capped to the context left (`get_max_tokens`)
    max_tokens: Int32 | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def to_sampling_params(self) -> SamplingParams:
        """Validated SamplingParams (RequestValidationError -> 400)."""
        if self.suffix is not None:
            raise RequestValidationError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestValidationError(
                f"best_of={self.best_of} is not supported: only best_of == n ({self.n})",
                "best_of",
            )
        return self._sampling_params(self.max_tokens, self.logprobs, constraint_of_request(self))


class CompletionLogProbs(OpenAIBaseModel):
    """Legacy logprobs of a completion choice."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    """One choice of a completion."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    """Response of POST /v1/completions."""

    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    """One choice of a streamed completion chunk."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    """One server-sent chunk of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- chat ---------------------------------------------------------------------------------


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: Int32 | None = None
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if not self.messages:
            raise ValueError("messages must be a non-empty list")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self

    def to_sampling_params(self) -> SamplingParams:
        """Validated SamplingParams (RequestValidationError -> 400)."""
        constraint = constraint_of_chat_request(self)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self._sampling_params(max_tokens, logprobs, constraint)


class FunctionCall(OpenAIBaseModel):
    """A function the model calls: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    """One tool call of an assistant message."""

    id: str = Field(default_factory=lambda: f"call_{random_uuid()[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    """Part of a streamed function call (name first, then pieces of the arguments)."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIBaseModel):
    """Part of a streamed tool call; ``index`` says which call it extends."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatMessage(OpenAIBaseModel):
    """An assistant message of a chat response."""

    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(OpenAIBaseModel):
    """The delta of a streamed chat chunk (unset fields are left out, like OpenAI's)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionLogProb(OpenAIBaseModel):
    """One top logprob entry of chat logprobs."""

    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """Logprob of one generated token with its top alternatives."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    """One choice of a chat response."""

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    """Response of POST /v1/chat/completions."""

    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One server-sent chunk of a streamed chat response."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- tokenize / detokenize ----------------------------------------------------------------


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(OpenAIBaseModel):
    """Tokens of a prompt."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Int64]


class DetokenizeResponse(OpenAIBaseModel):
    """Text of token ids."""

    prompt: str
