"""The bucket policy: the padded sizes a step may have.

A step's token count T is padded up to a token bucket (its request rows to
min(T, max_num_seqs)), and the sampler's rows up to a row bucket, so XLA compiles one
program per bucket, all during warm-up. A row of logits is one sampled token: one per
request, or with speculative decoding one per proposed token plus one per verified
request (at most ``max_logit_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

from xlm.config import XlmConfig


def default_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 1 up to the step's token budget (always included)."""
    buckets, b = [], 1
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_num_batched_tokens)
    return buckets


@dataclass(frozen=True)
class Buckets:
    """The padded sizes a step may have: token counts and sampler rows."""

    token_buckets: tuple[int, ...]
    sampler_buckets: tuple[int, ...]
    max_num_seqs: int
    # Logit rows one step may hold: max_num_seqs, or more with speculative decoding.
    max_logit_rows: int = 0

    def __post_init__(self) -> None:
        if self.max_logit_rows < self.max_num_seqs:
            object.__setattr__(self, "max_logit_rows", self.max_num_seqs)

    @classmethod
    def from_config(cls, config: XlmConfig) -> Buckets:
        sched = config.scheduler_config
        tokens = config.compilation_config.token_buckets or default_token_buckets(
            sched.max_num_batched_tokens
        )
        if tokens[-1] < sched.max_num_batched_tokens:
            raise ValueError(
                f"CompilationConfig.token_buckets={tokens} must reach "
                f"max_num_batched_tokens={sched.max_num_batched_tokens}"
            )
        # The sampler compiles per row bucket, fewer than token buckets (its logits are
        # padded up to the bucket): powers of four up to the most logit rows of a step.
        spec = config.speculative_config
        max_rows = sched.max_num_seqs if spec is None else spec.rows_needed(sched.max_num_seqs)
        rows = sorted({min(4**i, max_rows) for i in range(16)})
        return cls(tuple(tokens), tuple(rows), sched.max_num_seqs, max_rows)

    def token_bucket(self, num_tokens: int) -> int:
        for b in self.token_buckets:
            if b >= num_tokens:
                return b
        raise ValueError(
            f"step of {num_tokens} tokens exceeds the largest token bucket {self.token_buckets[-1]}"
        )

    def rows_for_tokens(self, num_tokens_padded: int) -> int:
        """Request rows of a model step of this token bucket."""
        return min(num_tokens_padded, self.max_num_seqs)

    def logit_rows_for_tokens(self, num_tokens_padded: int) -> int:
        """Logit rows a model step of this token bucket computes (each is a token)."""
        return min(num_tokens_padded, self.max_logit_rows)

    def sampler_bucket(self, num_rows: int) -> int:
        return next(b for b in self.sampler_buckets if b >= num_rows)
