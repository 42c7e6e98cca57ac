"""Which requests may be proposed tokens, and how many proposals pay for themselves."""

from __future__ import annotations

from typing import Any

from xlm.config import SpeculativeConfig
from xlm.sampling_params import uses_output_bans, uses_penalties


def may_speculate(sampling_params: Any) -> bool:
    """Whether a request may be proposed tokens: not when its sampling at a position
    depends on the tokens before it in ways the verifying rows do not see (penalties'
    counts, min_tokens and bad-word bans, a grammar's state); those decode one token a
    step, exactly as without speculation."""
    return not (
        uses_penalties(sampling_params)
        or uses_output_bans(sampling_params)
        or getattr(sampling_params, "structured_outputs", None) is not None
    )


class SpeculationPolicy:
    """How many of its k proposals a request is given: as many as pay for themselves.

    Verifying k proposals makes the step k tokens longer. On an accelerator, where one
    step streams the weights once whatever its length, that is nearly free; on XLA:CPU a
    step of 2-4 tokens costs 1.5-3x a step of one (its dot is slower for a few rows than
    for one: benchmarks/RESULTS.md, "Speculative decoding"). So the runner times its steps
    by token bucket, each request keeps an estimate of how often its proposals are
    accepted, and a request is proposed the k that maximizes expected tokens per second:
    (1 + a + a^2 + ... + a^k) / (time of the longer step / time of the plain one). A bucket
    not timed yet counts as free (so it gets tried, then timed), except the plain step's:
    once a longer step is timed, steps go without proposals until the plain one is too; a
    request proposed nothing drifts back towards the prior, so it is tried again later.
    """

    PRIOR = 0.6  # acceptance assumed before a request's first verification
    WEIGHT = 0.3  # of the newest verification in a request's estimate

    def __init__(self, config: SpeculativeConfig, bucket_of: Any) -> None:
        self.k = config.num_speculative_tokens
        self.adaptive = config.adaptive
        self.bucket_of = bucket_of
        self.step_s: dict[int, float] = {}
        self._timed_once: set[int] = set()

    def record_step(self, bucket: int, seconds: float) -> None:
        """A step of this token bucket took `seconds` (its first run, which may have
        loaded or compiled its programs, is not counted)."""
        if bucket not in self._timed_once:
            self._timed_once.add(bucket)
            return
        old = self.step_s.get(bucket)
        self.step_s[bucket] = seconds if old is None else old + 0.3 * (seconds - old)

    def record_verification(self, state: Any, proposed: int, accepted: int) -> None:
        state.spec_acceptance += self.WEIGHT * (accepted / proposed - state.spec_acceptance)

    def num_to_propose(self, state: Any, num_rows: int, round_s: float = 0.0) -> int:
        """The k for this request in a step of `num_rows` tokens without proposals, when
        proposing each token costs `round_s` (a draft model's step; 0 for a lookup)."""
        if not self.adaptive:
            return self.k
        a = state.spec_acceptance
        t0 = self.step_s.get(self.bucket_of(num_rows))
        if t0 is None and any(
            self.bucket_of(num_rows + k) in self.step_s for k in range(1, self.k + 1)
        ):
            # Longer steps are timed but not the plain one (a draft model always has a
            # proposal): a step without, to time it.
            return 0
        best_k, best_gain, expected = 0, 1.0, 0.0
        for k in range(1, self.k + 1):
            expected += a**k
            t = self.step_s.get(self.bucket_of(num_rows + k))
            ratio = (t + k * round_s) / t0 if t is not None and t0 else 1.0
            gain = (1.0 + expected) / ratio
            if gain > best_gain:
                best_k, best_gain = k, gain
        if best_k == 0:  # not now; back towards the prior, to be tried again
            state.spec_acceptance += 0.1 * (self.PRIOR - state.spec_acceptance)
        return best_k
