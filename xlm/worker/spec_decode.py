"""Speculative decoding on the worker side: proposers and the per-step proposal pass.

After a step's tokens are known, the runner asks the proposer for each decoding request's
next tokens (``ModelRunnerOutput.spec_token_ids``); the scheduler schedules them after the
request's last token (``SchedulerOutput.scheduled_spec_decode_tokens``), the model step
computes them like known tokens, and the sampler verifies them
(``xlm.worker.sampler._verify_random``; greedy rows compare with the argmax).

A proposer is anything with ``propose_batch(batch, wanted) -> {req_id: tokens}`` over the
runner's persistent batch: ``NgramProposer`` is prompt lookup, one request at a time on
the host; ``DraftModelProposer`` runs a smaller model greedily on the device, all
requests together, on a KV cache of its own. EAGLE-style heads, which read the target's
hidden states, would take the same seam with the step's hidden states added.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from xlm.config import SpeculativeConfig
from xlm.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from xlm.sampling_params import SamplingParams, uses_output_bans, uses_penalties


class Proposer(Protocol):
    """Proposes tokens to follow the known tokens of requests of the runner's batch."""

    def propose_batch(self, batch: Any, wanted: dict[str, int]) -> dict[str, list[int]]:
        """Up to `wanted[req_id]` tokens for each request (fewer, or none, allowed)."""
        ...

    def seconds_per_round(self, num_requests: int) -> float:
        """What proposing one more token to each of `num_requests` requests costs."""
        ...


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

    def propose_batch(self, batch: Any, wanted: dict[str, int]) -> dict[str, list[int]]:
        out = {}
        for req_id, k in wanted.items():
            slot = batch.requests[req_id].slot
            out[req_id] = self.propose(batch.token_ids[slot, : batch.num_tokens[slot]], k)
        return out

    def seconds_per_round(self, num_requests: int) -> float:
        return 0.0  # a host lookup: nothing next to a step


class DraftModelProposer:
    """A smaller model with the target's vocabulary proposes k tokens greedily: k steps of
    its own runner (``xlm.worker.model_runner.ModelRunner``, its own programs and KV
    cache), every proposing request in each step.

    The draft keeps each request's tokens and K/V between proposals. At the next one, the
    tokens it computed that the target has since confirmed (the accepted proposals) stay;
    the rest are recomputed from the target's known tokens: the request is handed to the
    draft runner as resumed from preemption with its computed count set to the agreeing
    prefix, so the first of the k steps computes just the new tokens (the whole prompt, the
    first time, chunked by the step budget). Its blocks come from a pool of its own,
    freed when the target drops the request (finished or preempted).
    """

    def __init__(self, runner: Any, block_pool: Any, num_groups: int) -> None:
        self.runner = runner
        self.pool = block_pool
        self.num_groups = num_groups  # 0: one block table; else one per KV cache group
        self.block_size = runner.block_size
        self.budget = runner.buckets.token_buckets[-1]
        self.greedy = SamplingParams(temperature=0.0, max_tokens=runner.max_model_len)
        # req_id -> (the prompt it was added with, its blocks per group)
        self._held: dict[str, tuple[list[int], list[list[Any]]]] = {}
        self._round_s: dict[int, float] = {}

    # ---- cost (what SpeculationPolicy weighs) ------------------------------------------
    def seconds_per_round(self, num_requests: int) -> float:
        return self._round_s.get(self.runner.buckets.token_bucket(num_requests), 0.0)

    def _record_round(self, num_requests: int, seconds: float) -> None:
        bucket = self.runner.buckets.token_bucket(num_requests)
        old = self._round_s.get(bucket)
        self._round_s[bucket] = seconds if old is None else old + 0.3 * (seconds - old)

    # ---- blocks ----------------------------------------------------------------------
    def _grow(self, req_id: str, num_tokens: int) -> bool:
        """Give a request blocks (in every group) for `num_tokens` positions; False when
        the pool cannot (the request is not proposed)."""
        blocks = self._held[req_id][1]
        need = -(-num_tokens // self.block_size) - len(blocks[0])
        if need <= 0:
            return True
        if need * len(blocks) > self.pool.get_num_free_blocks():
            return False
        for have in blocks:
            have.extend(self.pool.get_new_blocks(need))
        return True

    def _ids(self, per_group: list[list[Any]]) -> Any:
        """Block ids as the runner takes them: one list, or a tuple of one per group."""
        ids = [[b.block_id for b in g] for g in per_group]
        return tuple(ids) if self.num_groups else ids[0]

    def _drop(self, req_id: str) -> None:
        _, blocks = self._held.pop(req_id)
        for group in blocks:
            self.pool.free_blocks(group)

    # ---- proposing -------------------------------------------------------------------
    def propose_batch(self, batch: Any, wanted: dict[str, int]) -> dict[str, list[int]]:
        draft = self.runner.input_batch
        # Requests the target no longer runs (finished, preempted): free their blocks.
        gone = {r for r in self._held if r not in batch.requests or batch.requests[r].slot < 0}
        for req_id in gone:
            self._drop(req_id)
            draft.release(req_id, forget=True)
        new_reqs: list[Any] = []
        cached = CachedRequestData()
        todo: dict[str, int] = {}  # tokens each request computes before its first proposal
        for req_id, k in wanted.items():
            slot = batch.requests[req_id].slot
            n = int(batch.num_tokens[slot])
            tokens = batch.token_ids[slot, :n]
            if req_id not in self._held:
                self._held[req_id] = (tokens.tolist(), [[] for _ in range(self.num_groups or 1)])
                agree = 0
            else:
                state = draft.requests[req_id]
                have = draft.token_ids[state.slot, : draft.num_computed_tokens[state.slot]]
                m = min(len(have), n)
                diff = np.flatnonzero(have[:m] != tokens[:m])
                agree = int(diff[0]) if diff.size else m
            # K/V for the known tokens and the k - 1 proposals fed back.
            if not self._grow(req_id, n + k - 1):
                self._drop(req_id)
                if req_id in draft.requests:
                    draft.release(req_id, forget=True)
                continue
            prompt, blocks = self._held[req_id]
            agree = min(agree, n - 1)  # the last known token is computed here
            if req_id in draft.requests:
                cached.req_ids.append(req_id)
                cached.resumed_from_preemption.append(True)
                cached.new_block_ids.append(self._ids(blocks))
                cached.num_computed_tokens.append(agree)
                cached.new_token_ids.append(tokens[len(prompt) :].tolist())
            else:
                new_reqs.append(
                    NewRequestData(req_id, prompt, self.greedy, self._ids(blocks), agree)
                )
            todo[req_id] = n - agree
        out: dict[str, list[int]] = {r: [] for r in wanted}
        # First the known tokens each request has not computed (chunked by the budget),
        # then one token a step: each step's sampled tokens are the proposals.
        while todo:
            step: dict[str, int] = {}
            left = self.budget
            for req_id, count in todo.items():
                if left == 0:
                    break
                step[req_id] = min(count, left)
                left -= step[req_id]
            so = SchedulerOutput(
                scheduled_new_reqs=[r for r in new_reqs if r.req_id in step],
                scheduled_cached_reqs=_only(cached, step),
                num_scheduled_tokens=step,
                total_num_scheduled_tokens=sum(step.values()),
                finished_req_ids=set(),
                preempted_req_ids=set(),
            )
            new_reqs = [r for r in new_reqs if r.req_id not in step]
            cached = _without(cached, step)
            started = time.perf_counter()
            result = self.runner.execute_model(so)
            if so.total_num_scheduled_tokens == len(step):
                # A step of one token per request: what each further proposal costs (a
                # request's first step also computes the tokens it has not seen: a whole
                # prompt the first time, so it is not counted).
                self._record_round(len(step), time.perf_counter() - started)
            for req_id, sampled, count in zip(
                result.req_ids, result.sampled_token_ids, (step[r] for r in result.req_ids)
            ):
                todo[req_id] -= count
                if not sampled:  # a chunk of its known tokens: more to compute first
                    self._continue(cached, req_id)
                    continue
                out[req_id].extend(sampled)
                if len(out[req_id]) < wanted[req_id]:
                    todo[req_id] = 1  # feed the proposal back
                    self._continue(cached, req_id)
                else:
                    del todo[req_id]
        return out

    def _continue(self, cached: Any, req_id: str) -> None:
        """Schedule a request the draft runner holds for one more token (no new blocks:
        `_grow` gave it room for all k)."""
        draft = self.runner.input_batch
        slot = draft.requests[req_id].slot
        cached.req_ids.append(req_id)
        cached.resumed_from_preemption.append(False)
        cached.new_block_ids.append(self._ids([[] for _ in range(self.num_groups or 1)]))
        cached.num_computed_tokens.append(int(draft.num_computed_tokens[slot]))
        cached.new_token_ids.append([])


def _only(cached: Any, step: dict[str, int]) -> Any:
    """The rows of `cached` whose requests run in this step."""
    keep = [i for i, r in enumerate(cached.req_ids) if r in step]
    return CachedRequestData(
        [cached.req_ids[i] for i in keep],
        [cached.resumed_from_preemption[i] for i in keep],
        [cached.new_block_ids[i] for i in keep],
        [cached.num_computed_tokens[i] for i in keep],
        [cached.new_token_ids[i] for i in keep],
    )


def _without(cached: Any, step: dict[str, int]) -> Any:
    """The rows of `cached` not yet handed to the draft runner."""
    rest = {r: 0 for r in cached.req_ids if r not in step}
    return _only(cached, rest)


def make_ngram_proposer(config: SpeculativeConfig) -> Proposer:
    """Prompt lookup with the config's n-gram sizes (a draft model's proposer needs its own
    runner: xlm.worker.worker builds it)."""
    if config.method != "ngram":
        raise ValueError(f"SpeculativeConfig.method={config.method!r} is not 'ngram'")
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


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
    states = batch.requests
    candidates = [
        r for r in req_ids if r in states and states[r].slot >= 0 and states[r].may_speculate
    ]
    round_s = proposer.seconds_per_round(len(candidates)) if candidates else 0.0
    wanted: dict[str, int] = {}
    for req_id in candidates:
        state = states[req_id]
        room = batch.max_model_len - int(batch.num_tokens[state.slot])
        k = min(policy.num_to_propose(state, num_rows, round_s), room)
        if k > 0:
            wanted[req_id] = k
    proposals = proposer.propose_batch(batch, wanted) if wanted else {}
    return [proposals.get(r, []) for r in req_ids]
