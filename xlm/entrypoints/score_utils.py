"""Scoring text pairs, shared by LLM.score and the server's /score and /rerank.

As in vLLM, a pair is scored one of two ways, by what the pooling model is:
- a cross-encoder (a single-label classifier, `--convert classify`): the pair is one
  input, encoded as the tokenizer's text pair, `tokenizer(text_1, text_2)` (a BERT-style
  tokenizer's `[CLS] a [SEP] b [SEP]`; a decoder tokenizer without a pair template gives
  text_1's tokens then text_2's, with whatever special tokens it adds to each), and its
  score is the sigmoid of the head's one logit;
- an embedder: each text is embedded alone and the score is the cosine of the two vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xlm.engine.exceptions import RequestValidationError
from xlm.outputs import ClassificationOutput
from xlm.pooling_params import PoolingParams

_EPS = 1e-12


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The pairs of vLLM's score API: 1-to-1, 1-to-N (text_1 against every text_2) or
    N-to-N (element-wise); RequestValidationError naming the field otherwise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise RequestValidationError(f"{name} must not be empty", name)
        if not all(isinstance(t, str) for t in texts):
            raise RequestValidationError(f"{name} must be a string or a list of strings", name)
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise RequestValidationError(
            f"text_1 has {len(first)} entries and text_2 has {len(second)}: allowed 1 text_1 "
            "for any number of text_2 (1-to-N), or as many text_1 as text_2 (N-to-N)",
            "text_2",
        )
    return list(zip(first, second, strict=True))


def check_scoring_model(pooling: Any) -> bool:
    """Whether the pooling model (Processor.pooling) scores pairs as a cross-encoder (True)
    or by the cosine of embeddings (False); RequestValidationError when it cannot score."""
    if pooling is None:
        raise RequestValidationError(
            "This model generates text (runner 'generate'): it does not score or rerank; "
            "serve a cross-encoder (*ForSequenceClassification, or --convert classify) or an "
            "embedding model (--runner pooling)",
            "model",
        )
    if pooling.labels is not None and len(pooling.labels) != 1:
        raise RequestValidationError(
            f"This classifier has {len(pooling.labels)} labels: scoring and reranking need a "
            "single-label classifier (a cross-encoder's one relevance logit); use classify "
            "for its label probabilities",
            "model",
        )
    return pooling.labels is not None


def check_classifier(pooling: Any) -> tuple[str, ...]:
    """The labels of a model that classifies; RequestValidationError for a generating
    model (an embedder is refused by the processor, per request)."""
    if pooling is None:
        raise RequestValidationError(
            "This model generates text (runner 'generate'): it does not classify; serve "
            "a *ForSequenceClassification checkpoint or start it with --convert classify",
            "model",
        )
    return pooling.labels


def score_inputs(
    tokenizer: Any, pairs: Sequence[tuple[str, str]], cross_encoder: bool
) -> tuple[list[list[int]], PoolingParams | None]:
    """The token ids to pool for `pairs` and the pooling to run (None: the model's default).

    A cross-encoder pools one input per pair; an embedder pools every text_1 then every
    text_2 (2 x len(pairs) inputs; `pair_scores` pairs them back up).
    """
    if cross_encoder:
        ids = [list(tokenizer(a, b)["input_ids"]) for a, b in pairs]
        return ids, PoolingParams(task="classify")
    texts = [a for a, _ in pairs] + [b for _, b in pairs]
    return [list(tokenizer.encode(t)) for t in texts], None


def pair_scores(vectors: Sequence[np.ndarray], cross_encoder: bool) -> list[float]:
    """One score per pair from `score_inputs`' pooled outputs, in pair order."""
    if cross_encoder:
        return [float(v[0]) for v in vectors]
    n = len(vectors) // 2
    first = np.stack([np.asarray(v, np.float64) for v in vectors[:n]])
    second = np.stack([np.asarray(v, np.float64) for v in vectors[n:]])
    norms = np.linalg.norm(first, axis=1) * np.linalg.norm(second, axis=1)
    return (np.sum(first * second, axis=1) / np.maximum(norms, _EPS)).tolist()


def score_token_ids(ids: Sequence[list[int]], cross_encoder: bool) -> list[list[int]]:
    """Each pair's prompt tokens (an embedder's: text_1's then text_2's)."""
    if cross_encoder:
        return [list(i) for i in ids]
    n = len(ids) // 2
    return [list(ids[i]) + list(ids[n + i]) for i in range(n)]


def classification(probs: np.ndarray, labels: Sequence[str]) -> ClassificationOutput:
    """A classifier's output for one input: its probabilities and its likeliest label."""
    values = [float(p) for p in np.asarray(probs).reshape(-1)]
    return ClassificationOutput(probs=values, label=labels[int(np.argmax(values))])
