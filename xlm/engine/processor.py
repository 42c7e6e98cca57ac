"""Processor: a user prompt plus SamplingParams -> a validated EngineCoreRequest."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from xlm.config import ModelConfig, XlmConfig
from xlm.engine.exceptions import RequestValidationError
from xlm.engine.messages import EngineCoreRequest
from xlm.lora.request import LoRARequest
from xlm.models.pooling_config import label_names
from xlm.multimodal.image import DEFAULT_MAX_IMAGE_PIXELS, MediaPolicy
from xlm.multimodal.processing import MultiModalProcessor, get_mm_processor
from xlm.multimodal.processor_config import resolve_processor_config
from xlm.pooling_params import PoolingParams
from xlm.sampling_params import MAX_DEVICE_LOGPROBS, RequestOutputKind, SamplingParams
from xlm.structured_output.backend import validate as validate_structured_outputs
from xlm.tokenizer import get_eos_token_ids, get_tokenizer

PromptType = str | list[int] | dict[str, Any]

_CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code
# Images per prompt when --limit-mm-per-prompt does not say.
DEFAULT_IMAGES_PER_PROMPT = 16


@dataclass(frozen=True)
class PoolingModel:
    """What the processor checks a pooling request against."""

    defaults: PoolingParams
    hidden_size: int
    max_tokens: int  # per input: the step's token budget
    # A classifier's labels (--convert classify): its requests are "classify" ones.
    labels: tuple[str, ...] | None = None


class Processor:
    """Tokenizes and validates prompts against the model's limits."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int | None = None,
        eos_token_id: int | list[int] | None = None,
        generation_config: dict[str, Any] | None = None,
        max_logprobs: int = MAX_DEVICE_LOGPROBS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        if vocab_size is None:
            if tokenizer is None:
                raise ValueError("Processor needs vocab_size when there is no tokenizer")
            vocab_size = len(tokenizer)
        self.vocab_size = vocab_size
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
        eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        self.eos_token_ids = eos_ids
        self.generation_config = dict(generation_config or {})
        self.max_logprobs = max_logprobs
        # Set for a pooling model (from_config): its pooling defaults and the step budget
        # a pooled prompt must fit in (it is prefilled in one step).
        self.pooling: PoolingModel | None = None
        # Set for a multimodal model (from_config): its processor and items per prompt.
        self.mm_processor: MultiModalProcessor | None = None
        self.mm_limits: dict[str, int] = {"image": DEFAULT_IMAGES_PER_PROMPT}
        self.media_policy = MediaPolicy()

    @classmethod
    def from_config(cls, config: XlmConfig) -> Processor:
        """The processor of a configured model: its tokenizer, length, EOS and defaults."""
        model_config = config.model_config
        tokenizer = get_tokenizer(
            model_config.model,
            model_config.tokenizer,
            trust_remote_code=model_config.trust_remote_code,
        )
        generation_config = load_generation_config(model_config)
        eos_ids = get_eos_token_ids(tokenizer, model_config.hf_config, generation_config)
        processor = cls(
            tokenizer,
            model_config.max_model_len,
            vocab_size=model_config.hf_config.vocab_size,
            eos_token_id=sorted(eos_ids),
            generation_config=generation_config,
        )
        processor.media_policy = media_policy(model_config)
        processor.mm_processor = get_mm_processor(
            model_config.hf_config,
            model_config.model,
            processor.media_policy,
            resolve_processor_config(config),
        )
        if model_config.limit_mm_per_prompt:
            processor.mm_limits.update(model_config.limit_mm_per_prompt)
        if model_config.is_pooling:
            labels = label_names(model_config.hf_config) if model_config.is_classifier else None
            processor.pooling = PoolingModel(
                model_config.default_pooling or PoolingParams(),
                model_config.hf_config.hidden_size,
                config.scheduler_config.max_num_batched_tokens,
                tuple(labels) if labels is not None else None,
            )
        return processor

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError(
                    f"prompt dict has keys {sorted(prompt)}: expected 'prompt' or "
                    "'prompt_token_ids'"
                )
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(
            f"prompt of type {type(prompt).__name__} is invalid: expected str, list[int] or "
            "a dict with 'prompt' or 'prompt_token_ids'"
        )

    def process_multimodal(
        self, token_ids: list[int], mm_data: Any
    ) -> tuple[list[int], list[Any] | None]:
        """Images of a prompt ({"image": PIL image or list}) -> the prompt with each
        placeholder expanded, and one feature per image (RequestValidationError, a 400,
        for what the model or the limits refuse)."""
        if not mm_data:
            return token_ids, None
        if not isinstance(mm_data, dict):
            raise RequestValidationError(
                f"multi_modal_data of type {type(mm_data).__name__} is invalid: expected a "
                'dict like {"image": image or [images]}',
                "multi_modal_data",
            )
        unknown = sorted(set(mm_data) - {"image"})
        if unknown:
            raise RequestValidationError(
                f"multi_modal_data has modalities {unknown}: allowed 'image'",
                "multi_modal_data",
            )
        if self.mm_processor is None:
            raise RequestValidationError(
                "This model takes text only: it does not accept images", "multi_modal_data"
            )
        images = mm_data["image"]
        images = list(images) if isinstance(images, list | tuple) else [images]
        limit = self.mm_limits.get("image", DEFAULT_IMAGES_PER_PROMPT)
        if len(images) > limit:
            raise RequestValidationError(
                f"The prompt has {len(images)} images, more than the {limit} allowed per "
                "prompt (--limit-mm-per-prompt)",
                "multi_modal_data",
            )
        return self.mm_processor.process(token_ids, images)

    def check_pooling_request(
        self, token_ids: list[int], params: PoolingParams | None
    ) -> tuple[SamplingParams, PoolingParams]:
        """Check a prompt to embed; the placeholder sampling and the pooling to run.

        A pooled prompt is prefilled in one step, so it must fit the step's token budget.
        """
        pooling = self.pooling
        if pooling is None:
            raise RequestValidationError(
                "This model generates text (runner 'generate'): it does not pool "
                "embeddings; start it with --runner pooling to serve embeddings",
                "model",
            )
        params = params if params is not None else pooling.defaults
        check_pooling_task(params.task, pooling.labels is not None)
        try:
            params.verify(pooling.hidden_size)
        except ValueError as e:
            raise RequestValidationError.from_value_error(e) from None
        self._check_prompt(token_ids, generates=False)
        if len(token_ids) > pooling.max_tokens:
            raise RequestValidationError(
                f"The input has {len(token_ids)} tokens, more than the {pooling.max_tokens} "
                "an input may have (the step budget, --max-num-batched-tokens: an input is "
                "embedded in one step)",
                "input",
                _CONTEXT_LENGTH_EXCEEDED,
            )
        sampling = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        return sampling, params

    def check_request(
        self,
        token_ids: list[int],
        params: SamplingParams,
        default_max_tokens: int | None = None,
    ) -> SamplingParams:
        """The one check of a prompt and its parameters against this model.

        Returns the parameters the engine will run (a copy: generation_config defaults
        applied, max_tokens from `get_max_tokens`); raises RequestValidationError naming
        the parameter. LLM and the server both go through here, once per request.
        `default_max_tokens` is a server's default for a request without max_tokens (the
        model's default caps it too); None (LLM): SamplingParams' own, or the model's.
        """
        if self.pooling is not None:
            raise RequestValidationError(
                "This model is an embedding model (runner 'pooling'): it does not generate "
                "text; use LLM.embed or /v1/embeddings",
                "model",
            )
        self._check_prompt(token_ids)
        return self._check_params(params, len(token_ids), default_max_tokens)

    def check_token_ids(self, token_ids: list[int]) -> None:
        """Each id an integer in the vocabulary (RequestValidationError naming the range)."""
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise RequestValidationError(
                    f"prompt token id {token_id!r} is not an integer", "prompt"
                )
            if not 0 <= token_id < self.vocab_size:
                raise RequestValidationError(
                    f"prompt token id {token_id} is out of vocabulary: allowed [0, "
                    f"{self.vocab_size})",
                    "prompt",
                )

    def _check_prompt(self, token_ids: list[int], generates: bool = True) -> None:
        if not token_ids:
            raise RequestValidationError("The prompt is empty: give at least one token", "prompt")
        self.check_token_ids(token_ids)
        if not generates and len(token_ids) > self.max_model_len:
            raise RequestValidationError(
                f"The input has {len(token_ids)} tokens, more than the maximum model length "
                f"of {self.max_model_len}",
                "input",
                _CONTEXT_LENGTH_EXCEEDED,
            )
        if generates and len(token_ids) >= self.max_model_len:
            raise RequestValidationError(
                f"The prompt (length {len(token_ids)}) is too long for the maximum model "
                f"length of {self.max_model_len}: it must be shorter, to leave room for at "
                "least one generated token",
                "prompt",
                _CONTEXT_LENGTH_EXCEEDED,
            )

    def _check_params(
        self, params: SamplingParams, prompt_len: int, default_max_tokens: int | None
    ) -> SamplingParams:
        params = params.clone()
        checked_max_tokens = params.max_tokens  # construction checked min_tokens against it
        try:
            params.update_from_generation_config(self.generation_config, self.eos_token_ids)
        except ValueError as e:
            raise RequestValidationError.from_value_error(e) from None
        given = params.max_tokens if params.was_given("max_tokens") else None
        if default_max_tokens is not None:
            defaults = (default_max_tokens, self.generation_config.get("max_new_tokens"))
        else:  # SamplingParams' default, or the model's in its place
            defaults = (params.max_tokens,)
        max_tokens = get_max_tokens(self.max_model_len, prompt_len, given, *defaults)
        params.max_tokens = max_tokens
        if max_tokens != checked_max_tokens:
            try:
                params.verify_min_tokens()
            except ValueError as e:
                raise RequestValidationError.from_value_error(e) from None
        self._check_logprobs(params)
        try:
            params.verify_vocab(self.vocab_size)
        except ValueError as e:
            raise RequestValidationError.from_value_error(e) from None
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)
        if params.bad_words and self.tokenizer is not None:
            params.update_from_tokenizer(self.tokenizer)
        return params

    def _check_logprobs(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise RequestValidationError(
                    f"SamplingParams.{name}={value} is invalid: allowed at most "
                    f"max_logprobs={self.max_logprobs} (see --max-logprobs)",
                    name,
                )

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        pooling: bool = False,
        lora_request: LoRARequest | None = None,
        default_max_tokens: int | None = None,
    ) -> EngineCoreRequest:
        """Tokenize and validate one prompt; the request keeps its own copy of ``params``.

        With `pooling` the prompt is embedded (`pooling_params`, else the model's default
        pooling) and `params` is ignored; a pooling model takes only such requests.
        """
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"lora_request={lora_request!r} is invalid: allowed a LoRARequest or None"
            )
        text, token_ids = self._tokenize(prompt)
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        token_ids, mm_features = self.process_multimodal(token_ids, mm_data)
        if mm_features and pooling:
            raise RequestValidationError(
                "Images are not supported for pooling requests", "multi_modal_data"
            )
        if pooling:
            params, pooling_params = self.check_pooling_request(token_ids, pooling_params)
        else:
            params = self.check_request(token_ids, params, default_max_tokens)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            prompt=text,
            pooling_params=pooling_params,
            lora_request=lora_request,
            mm_features=mm_features,
        )


def media_policy(model_config: ModelConfig) -> MediaPolicy:
    """Where images may come from and their pixel cap, from the model's options."""
    return MediaPolicy(
        allowed_local_media_path=model_config.allowed_local_media_path,
        allowed_media_domains=tuple(model_config.allowed_media_domains or ()),
        max_image_pixels=model_config.max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS,
    )


def get_max_tokens(
    max_model_len: int, prompt_len: int, max_tokens: int | None, *defaults: int | None
) -> int:
    """The max_tokens a request runs with: its own, which must fit the context left, else
    the least of the room left and the defaults (the server's, the model's) that are set."""
    room = max_model_len - prompt_len
    if max_tokens is None:
        return min(d for d in (room, *defaults) if d is not None)
    if max_tokens > room:
        raise RequestValidationError(
            f"'max_tokens' is too large: {max_tokens}. This model's maximum context length "
            f"is {max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_len})",
            "max_tokens",
            _CONTEXT_LENGTH_EXCEEDED,
        )
    return max_tokens


def load_generation_config(model_config: ModelConfig) -> dict[str, Any]:
    """Sampling defaults from generation_config.json ("auto"), none ("xlm"), or a directory."""
    if model_config.generation_config == "xlm":
        return {}
    where = (
        model_config.model
        if model_config.generation_config == "auto"
        else model_config.generation_config
    )
    path = os.path.join(where, "generation_config.json")
    if not os.path.isfile(path):
        if model_config.generation_config != "auto":
            raise FileNotFoundError(f"generation_config={where!r}: no {path}")
        return {}
    with open(path) as f:
        return json.load(f)


def check_pooling_task(task: str, is_classifier: bool) -> None:
    """Refuse a request the pooling model cannot answer: label scores from an embedder,
    vectors from a classifier (RequestValidationError naming the model)."""
    if task == "classify" and not is_classifier:
        raise RequestValidationError(
            "This model is an embedding model (--convert embed): it has no classification "
            "head, so it does not classify or score pairs as a cross-encoder; serve a "
            "*ForSequenceClassification checkpoint or start it with --convert classify",
            "model",
        )
    if task == "embed" and is_classifier:
        raise RequestValidationError(
            "This model is a classifier (--convert classify): it returns label scores, not "
            "embeddings; use LLM.classify/LLM.score or /classify, /score and /rerank",
            "model",
        )
