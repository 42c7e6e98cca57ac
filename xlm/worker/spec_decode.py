"""Speculative decoding on the worker side: proposers and the per-step proposal pass.

After a step's tokens are known, the runner asks the proposer for each decoding request's
next tokens (``ModelRunnerOutput.spec_token_ids``); the scheduler schedules them after the
request's last token (``SchedulerOutput.scheduled_spec_decode_tokens``), the model step
computes them like known tokens, and the sampler verifies them
(``xlm.worker.sampler._verify_random``; greedy rows compare with the argmax).

A proposer is anything with ``propose(tokens, k) -> list[int]`` over one request's known
tokens: ``NgramProposer`` is prompt lookup. A proposer that needs the device (a draft
model, EAGLE-style heads reading the target's hidden states) takes the same seam with a
batched ``propose_batch``.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from xlm.config import SpeculativeConfig
from xlm.sampling_params import uses_output_bans, uses_penalties


class Proposer(Protocol):
    """Proposes up to k tokens to follow a request's known tokens."""

    def propose(self, tokens: np.ndarray, k: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup: the longest suffix of n tokens (max_n down to min_n) seen earlier in
    the request proposes the k tokens that followed its latest earlier occurrence with k
    tokens after it (else the earliest occurrence's)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Windows of n tokens that end before the last token (so something follows).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The latest occurrence with k tokens after it; else the earliest (in a
                # loop the latest overlaps the suffix and has only a token or two after).
                full = hits[hits + n + k <= length]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start : start + k].tolist()
        return []


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of a speculative config (only "ngram" exists yet)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"SpeculativeConfig.method={config.method!r} has no proposer")


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
    not timed yet counts as free (so it gets tried, then timed); a request proposed
    nothing drifts back towards the prior, so it is tried again later.
    """

    PRIOR = 0.6  # acceptance assumed before a request's first verification
    WEIGHT = 0.3  # of the newest verification in a request's estimate

    def __init__(self, config: SpeculativeConfig, bucket_of: Any) -> None:
        self.k = config.num_speculative_tokens
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

    def num_to_propose(self, state: Any, num_rows: int) -> int:
        """The k for this request in a step of `num_rows` tokens without proposals."""
        a = state.spec_acceptance
        t0 = self.step_s.get(self.bucket_of(num_rows))
        best_k, best_gain, expected = 0, 1.0, 0.0
        for k in range(1, self.k + 1):
            expected += a**k
            t = self.step_s.get(self.bucket_of(num_rows + k))
            ratio = t / t0 if t is not None and t0 else 1.0
            gain = (1.0 + expected) / ratio
            if gain > best_gain:
                best_k, best_gain = k, gain
        if best_k == 0:  # not now; back towards the prior, to be tried again
            state.spec_acceptance += 0.1 * (self.PRIOR - state.spec_acceptance)
        return best_k


def propose_for_batch(
    proposer: Proposer,
    policy: SpeculationPolicy,
    config: SpeculativeConfig,
    batch: Any,
    req_ids: list[str],
) -> list[list[int]]:
    """Proposals for the requests that just sampled (one list per request, maybe empty).

    Nothing while more than ``disable_by_batch_size`` requests hold rows; each request is
    proposed what its policy allows, short of its context limit (the scheduler trims to
    max_tokens and the pool).
    """
    limit = config.disable_by_batch_size
    num_rows = len(batch)
    if limit is not None and num_rows > limit:
        return [[] for _ in req_ids]
    out: list[list[int]] = []
    states = batch.requests
    for req_id in req_ids:
        state = states.get(req_id)
        if state is None or state.slot < 0 or not state.may_speculate:
            out.append([])
            continue
        n = int(batch.num_tokens[state.slot])
        room = min(policy.num_to_propose(state, num_rows), batch.max_model_len - n)
        out.append(proposer.propose(batch.token_ids[state.slot, :n], room) if room > 0 else [])
    return out
