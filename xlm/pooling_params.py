"""PoolingParams: how to pool one embedding request, validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

# What a pooling request asks for: a vector (embed) or a classifier's label scores.
POOLING_TASKS = ("embed", "classify")


class PoolingType(enum.IntEnum):
    """Which hidden states make the vector: the last token's, the mean, or the first's."""

    LAST = 0
    MEAN = 1
    CLS = 2

    @classmethod
    def parse(cls, value: Any) -> PoolingType:
        """A PoolingType from itself or its case-insensitive name ("last", "mean", "cls")."""
        if isinstance(value, PoolingType):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        allowed = ", ".join(m.lower() for m in cls.__members__)
        raise ValueError(f"PoolingParams.pooling_type={value!r} is invalid: allowed {allowed}")


@dataclass
class PoolingParams:
    """How a pooling request turns its prompt's hidden states into one vector.

    pooling_type: last token (decoder embedders: Qwen3-Embedding, e5-mistral), mean, or
    CLS/first. dimensions: Matryoshka truncation to the first N components (before
    normalization). normalize: L2-normalize the vector (embed only). task: "embed" (the
    hidden state) or "classify" (a classifier's label scores, `--convert classify`).
    activation (classify): one label's score through a sigmoid, several labels' through a
    softmax (vLLM's convention); False keeps the raw logits.
    """

    pooling_type: PoolingType | str = PoolingType.LAST
    normalize: bool = True
    dimensions: int | None = None
    task: str = "embed"
    activation: bool = True

    def __post_init__(self) -> None:
        self.pooling_type = PoolingType.parse(self.pooling_type)
        if self.task not in POOLING_TASKS:
            raise ValueError(
                f"PoolingParams.task={self.task!r} is invalid: allowed {', '.join(POOLING_TASKS)}"
            )
        if not isinstance(self.activation, bool):
            raise ValueError(
                f"PoolingParams.activation={self.activation!r} is invalid: allowed True or False"
            )
        if not isinstance(self.normalize, bool):
            raise ValueError(
                f"PoolingParams.normalize={self.normalize!r} is invalid: allowed True or False"
            )
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int)
            or isinstance(self.dimensions, bool)
            or self.dimensions < 1
        ):
            raise ValueError(
                f"PoolingParams.dimensions={self.dimensions!r} is invalid: allowed None or an "
                f"integer >= 1"
            )

    @property
    def uses_last_token_only(self) -> bool:
        """Whether the vector reads only the last prompt token (a cached prefix is fine)."""
        return self.pooling_type == PoolingType.LAST

    def verify(self, hidden_size: int) -> None:
        """Check the request fits the model: dimensions at most its hidden size."""
        if self.task == "classify" and self.dimensions is not None:
            raise ValueError(
                f"PoolingParams.dimensions={self.dimensions} is invalid with task 'classify': "
                "allowed None (a classifier returns one score per label)"
            )
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(
                f"PoolingParams.dimensions={self.dimensions} is invalid: allowed 1 to "
                f"{hidden_size} (the model's hidden size)"
            )
