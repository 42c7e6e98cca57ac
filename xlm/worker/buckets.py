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

# A step with at most this many real rows of logits (one prompt's prefill, a few decodes in
# a large bucket) computes its LM head on that many rows (one or FEW_ROWS) and samples on
# FEW_ROWS rows: the model program also outputs its first FEW_ROWS rows of logits, and the
# sampler of that bucket takes them (docs/engine.md, "Buckets and compile time").
FEW_ROWS = 8

# The LM head's few-rows tiers: a step whose real logit rows fit one (a prompt's prefill: 1;
# a few decodes in a large bucket: FEW_ROWS) computes that many rows and zeros for the rest
# (xlm.worker.programs.lm_head_logits).
LOGIT_ROW_TIERS = (1, FEW_ROWS)

# From this many tokens up, the buckets step by 1.5x as well as 2x (16, 24, 32, 48, 64, ...):
# a prompt's prefill pads by at most a third instead of a half (docs/engine.md, "Buckets
# and compile time"); below it a step is a few decodes, whose time hardly depends on T.
FINE_BUCKETS_FROM = 16


def default_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 1 up to the step's token budget (always included), and from
    FINE_BUCKETS_FROM up the 1.5x midpoints between them."""
    buckets, b = [], 1
    while b < max_num_batched_tokens:
        buckets.append(b)
        if b >= FINE_BUCKETS_FROM and b * 3 // 2 < max_num_batched_tokens:
            buckets.append(b * 3 // 2)
        b *= 2
    buckets.append(max_num_batched_tokens)
    return buckets


@dataclass(frozen=True)
class StepShape:
    """The padded sizes of one step, chosen once (by step_inputs) and read by the runner."""

    num_tokens: int  # the token bucket
    logit_rows: int  # logit rows the model program gathers
    sampler_rows: int  # the sampler bucket it runs: the logit rows' or the few-rows one
    few_rows: bool  # whether that is the few-rows bucket (its logits output apart)


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
        # padded up to the bucket): powers of two up to the most logit rows of a step, so a
        # step pads at most to twice its rows (the sampler's time grows with its rows).
        spec = config.speculative_config
        max_rows = sched.max_num_seqs if spec is None else spec.rows_needed(sched.max_num_seqs)
        rows = sorted({min(2**i, max_rows) for i in range(32)})
        return cls(tuple(tokens), tuple(rows), sched.max_num_seqs, max_rows)

    def token_bucket(self, num_tokens: int) -> int:
        for b in self.token_buckets:
            if b >= num_tokens:
                return b
        raise ValueError(
            f"step of {num_tokens} tokens exceeds the largest token bucket {self.token_buckets[-1]}"
        )

    def serving_buckets(self) -> list[int]:
        """The token buckets made ready before serving ("largest"): the largest, which holds
        any step, and the first fine one (FINE_BUCKETS_FROM), which holds a short prompt's
        prefill and the decodes of as many requests; such a step padded into the largest
        instead costs ~100x more on a CPU (docs/engine.md, "Start-up")."""
        return sorted({self.first_fine_bucket, self.token_buckets[-1]})

    @property
    def first_fine_bucket(self) -> int:
        """The bucket of a FINE_BUCKETS_FROM-token step: below it, a step is a few decodes,
        whose time hardly depends on its padding."""
        return self.token_bucket(min(FINE_BUCKETS_FROM, self.token_buckets[-1]))

    def rows_for_tokens(self, num_tokens_padded: int) -> int:
        """Request rows of a model step of this token bucket."""
        return min(num_tokens_padded, self.max_num_seqs)

    def logit_rows_for_tokens(self, num_tokens_padded: int) -> int:
        """Logit rows a model step of this token bucket computes (each is a token)."""
        return min(num_tokens_padded, self.max_logit_rows)

    def sampler_bucket(self, num_rows: int) -> int:
        return next(b for b in self.sampler_buckets if b >= num_rows)

    def few_rows_bucket(self, logit_rows: int) -> int | None:
        """The sampler bucket of a step of `logit_rows` logit rows whose real rows are few
        (at most FEW_ROWS), when it is smaller than the step's own; else None."""
        few = self.sampler_bucket(min(FEW_ROWS, self.max_logit_rows))
        return few if few < self.sampler_bucket(logit_rows) else None

    def sampler_buckets_for_tokens(self, num_tokens_padded: int) -> list[int]:
        """The sampler buckets a step of this token bucket may run: its logit rows' and,
        for a step with few real rows, the few-rows one."""
        logit_rows = self.logit_rows_for_tokens(num_tokens_padded)
        few = self.few_rows_bucket(logit_rows)
        return [self.sampler_bucket(logit_rows)] + ([few] if few is not None else [])

    def sampler_rows(self, logit_rows: int, real_rows: int) -> int:
        """The sampler bucket a step runs: its logit rows', or the few-rows one."""
        few = self.few_rows_bucket(logit_rows)
        return few if few is not None and real_rows <= few else self.sampler_bucket(logit_rows)

    def step_shape(self, num_tokens_padded: int, real_rows: int) -> StepShape:
        """The shape of a step of this token bucket with `real_rows` real logit rows."""
        logit_rows = self.logit_rows_for_tokens(num_tokens_padded)
        rows = self.sampler_rows(logit_rows, real_rows)
        few = rows < self.sampler_bucket(logit_rows)
        return StepShape(num_tokens_padded, logit_rows, rows, few)
