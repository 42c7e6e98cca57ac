"""SpeculativeConfig: speculative decoding's method and limits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from xlm.config.checks import _invalid, _positive_int, _require, parse_json_text

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: proposed tokens verified by the model in one step.

    ``ngram`` (prompt lookup): the longest suffix of a request's tokens, between
    ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens, that appeared earlier in its
    prompt or output proposes the ``num_speculative_tokens`` tokens that followed it.
    Verification keeps the output exactly the model's: greedy requests accept the
    matching prefix plus one token, sampled ones use rejection sampling
    (xlm.worker.sampler). No request is proposed tokens while more than
    ``disable_by_batch_size`` requests run: a full batch is bound by compute, not by
    reading the weights, and verifying k tokens per request costs k times the rows.

    ``draft_model``: ``model`` (a path or name, like the target's; its vocabulary must be
    the target's) runs greedily beside the target on a KV cache of its own, k steps per
    verification (xlm.worker.spec_decode.DraftModelProposer).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # None: speculate at any batch size.
    disable_by_batch_size: int | None = 8
    # Propose each request the k its measured acceptance and step costs repay
    # (xlm.worker.spec_decode.SpeculationPolicy); False: always num_speculative_tokens.
    adaptive: bool = True
    # The draft model of method "draft_model" (vLLM's key).
    model: str | None = None
    # Set by EngineArgs.create_config: the draft's ModelConfig (resolved path, HF config).
    draft_model_config: Any = field(default=None, repr=False)

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig | None:
        """From a dict or its JSON text (vLLM's ``--speculative-config``); None passes."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = parse_json_text("speculative_config", value)
        if not isinstance(value, dict):
            raise _invalid("EngineArgs", "speculative_config", value, "a dict or its JSON text")
        names = {f.name for f in dataclasses.fields(cls)} - {"draft_model_config"}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}: allowed {sorted(names)}"
            )
        return cls(**value)

    def __post_init__(self) -> None:
        owner = "SpeculativeConfig"
        _require(
            self.method in SPECULATIVE_METHODS,
            owner,
            "method",
            self.method,
            " or ".join(repr(m) for m in SPECULATIVE_METHODS),
        )
        k = self.num_speculative_tokens
        _require(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 16,
            owner,
            "num_speculative_tokens",
            k,
            "an integer from 1 to 16",
        )
        _positive_int(owner, "prompt_lookup_min", self.prompt_lookup_min)
        _positive_int(owner, "prompt_lookup_max", self.prompt_lookup_max)
        _require(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            owner,
            "prompt_lookup_min",
            self.prompt_lookup_min,
            f"<= prompt_lookup_max ({self.prompt_lookup_max})",
        )
        _positive_int(owner, "disable_by_batch_size", self.disable_by_batch_size, optional=True)
        _require(isinstance(self.adaptive, bool), owner, "adaptive", self.adaptive, "true or false")
        _require(
            (self.method == "draft_model") == (self.model is not None),
            owner,
            "model",
            self.model,
            "the draft model's path or name with method 'draft_model', else None",
        )

    @property
    def max_rows_per_request(self) -> int:
        """Sampler rows of one verified request: its proposals plus one."""
        return self.num_speculative_tokens + 1

    def rows_needed(self, max_num_seqs: int) -> int:
        """The most sampler rows one step may hold with speculation."""
        batch = min(max_num_seqs, self.disable_by_batch_size or max_num_seqs)
        return max(max_num_seqs, batch * self.max_rows_per_request)
