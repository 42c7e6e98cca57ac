"""A draft model as proposer: a smaller model on a runner, KV cache and blocks of its own."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xlm.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from xlm.sampling_params import SamplingParams


@dataclass
class DraftRequest:
    """A request the draft holds: the prompt it was added with and its blocks per group."""

    prompt: list[int]
    blocks: list[list[Any]] = field(default_factory=list)


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
        self._held: dict[str, DraftRequest] = {}
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
        blocks = self._held[req_id].blocks
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
        for group in self._held.pop(req_id).blocks:
            self.pool.free_blocks(group)

    # ---- proposing -------------------------------------------------------------------
    def propose_batch(self, batch: Any, wanted: dict[str, int]) -> dict[str, list[int]]:
        self._forget_gone(batch)
        new_reqs, cached, todo = self._hand_over(batch, wanted)
        return self._run(new_reqs, cached, todo, wanted)

    def _forget_gone(self, batch: Any) -> None:
        """Free the blocks of requests the target no longer runs (finished, preempted)."""
        gone = {r for r in self._held if r not in batch.requests or batch.requests[r].slot < 0}
        for req_id in gone:
            self._drop(req_id)
            self.runner.input_batch.release(req_id, forget=True)

    def _hand_over(
        self, batch: Any, wanted: dict[str, int]
    ) -> tuple[list[NewRequestData], CachedRequestData, dict[str, int]]:
        """The draft runner's new and resumed requests, and the tokens each computes
        before its first proposal (its known tokens past the prefix the draft agrees on)."""
        draft = self.runner.input_batch
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        todo: dict[str, int] = {}
        for req_id, k in wanted.items():
            slot = batch.requests[req_id].slot
            n = int(batch.num_tokens[slot])
            tokens = batch.token_ids[slot, :n]
            if req_id not in self._held:
                groups = [[] for _ in range(self.num_groups or 1)]
                self._held[req_id] = DraftRequest(tokens.tolist(), groups)
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
            held = self._held[req_id]
            agree = min(agree, n - 1)  # the last known token is computed here
            if req_id in draft.requests:
                cached.req_ids.append(req_id)
                cached.resumed_from_preemption.append(True)
                cached.new_block_ids.append(self._ids(held.blocks))
                cached.num_computed_tokens.append(agree)
                cached.new_token_ids.append(tokens[len(held.prompt) :].tolist())
            else:
                new_reqs.append(
                    NewRequestData(req_id, held.prompt, self.greedy, self._ids(held.blocks), agree)
                )
            todo[req_id] = n - agree
        return new_reqs, cached, todo

    def _run(
        self,
        new_reqs: list[NewRequestData],
        cached: CachedRequestData,
        todo: dict[str, int],
        wanted: dict[str, int],
    ) -> dict[str, list[int]]:
        """Steps of the draft runner: first the known tokens each request has not computed
        (chunked by the budget), then one token a step, whose sampled tokens are the
        proposals."""
        out: dict[str, list[int]] = {r: [] for r in wanted}
        while todo:
            step: dict[str, int] = {}
            left = self.budget
            for req_id, count in todo.items():
                if left == 0:
                    break
                step[req_id] = min(count, left)
                left -= step[req_id]
            scheduler_output = SchedulerOutput(
                scheduled_new_reqs=[r for r in new_reqs if r.req_id in step],
                scheduled_cached_reqs=_rows_in_step(cached, step),
                num_scheduled_tokens=step,
                total_num_scheduled_tokens=sum(step.values()),
                finished_req_ids=set(),
                preempted_req_ids=set(),
            )
            new_reqs = [r for r in new_reqs if r.req_id not in step]
            cached = _rows_not_in_step(cached, step)
            started = time.perf_counter()
            result = self.runner.execute_model(scheduler_output)
            if scheduler_output.total_num_scheduled_tokens == len(step):
                # A step of one token per request: what each further proposal costs (a
                # request's first step also computes the tokens it has not seen: a whole
                # prompt the first time, so it is not counted).
                self._record_round(len(step), time.perf_counter() - started)
            for req_id, sampled, count in zip(
                result.req_ids, result.sampled_token_ids, (step[r] for r in result.req_ids)
            ):
                todo[req_id] -= count
                if not sampled:  # a chunk of its known tokens: more to compute first
                    self._schedule_one_more(cached, req_id)
                    continue
                out[req_id].extend(sampled)
                if len(out[req_id]) < wanted[req_id]:
                    todo[req_id] = 1  # feed the proposal back
                    self._schedule_one_more(cached, req_id)
                else:
                    del todo[req_id]
        return out

    def _schedule_one_more(self, cached: CachedRequestData, req_id: str) -> None:
        """Schedule a request the draft runner holds for one more token (no new blocks:
        `_grow` gave it room for all k)."""
        draft = self.runner.input_batch
        slot = draft.requests[req_id].slot
        cached.req_ids.append(req_id)
        cached.resumed_from_preemption.append(False)
        cached.new_block_ids.append(self._ids([[] for _ in range(self.num_groups or 1)]))
        cached.num_computed_tokens.append(int(draft.num_computed_tokens[slot]))
        cached.new_token_ids.append([])


def _rows_in_step(cached: CachedRequestData, step: dict[str, int]) -> CachedRequestData:
    """The rows of `cached` whose requests run in this step."""
    keep = [i for i, r in enumerate(cached.req_ids) if r in step]
    return CachedRequestData(
        [cached.req_ids[i] for i in keep],
        [cached.resumed_from_preemption[i] for i in keep],
        [cached.new_block_ids[i] for i in keep],
        [cached.num_computed_tokens[i] for i in keep],
        [cached.new_token_ids[i] for i in keep],
    )


def _rows_not_in_step(cached: CachedRequestData, step: dict[str, int]) -> CachedRequestData:
    """The rows of `cached` not yet handed to the draft runner."""
    rest = {r: 0 for r in cached.req_ids if r not in step}
    return _rows_in_step(cached, rest)
