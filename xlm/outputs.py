"""What the engine returns to callers: RequestOutput, CompletionOutput, Logprob, and a
pooling model's PoolingRequestOutput (a vector, a classification or a score)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token, its 1-based rank in the vocabulary, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position; the first is None (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One completion (of the ``n`` of a request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the completion; None for EOS/length.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether this completion has ended."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (seconds, time.time() clock) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The output of one request: its prompt and its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    encoder_prompt: str | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, "
            f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens})"
        )


@dataclass(slots=True)
class PoolingOutput:
    """One prompt's vector (float32 numpy)."""

    data: Any

    @property
    def embedding(self) -> list[float]:
        """The vector as a list of floats (vLLM's EmbeddingOutput field)."""
        return self.data.tolist()


@dataclass(slots=True)
class PoolingRequestOutput:
    """The output of one pooling request: its prompt and its vector."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None


# vLLM's name for what LLM.embed returns.
EmbeddingRequestOutput = PoolingRequestOutput


@dataclass(slots=True)
class ClassificationOutput:
    """One prompt's label probabilities (sigmoid of one label, softmax of several) and the
    most probable label's name (config.id2label)."""

    probs: list[float]
    label: str

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    """One pair's score: a cross-encoder's relevance, or the cosine of two embeddings."""

    score: float


# vLLM's names for what LLM.classify and LLM.score return (`outputs` is a
# ClassificationOutput or a ScoringOutput).
ClassificationRequestOutput = PoolingRequestOutput
ScoringRequestOutput = PoolingRequestOutput
