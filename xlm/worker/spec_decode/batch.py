"""The runner's speculation state: proposals written into the batch before a step,
verifications and step times recorded after it, the next proposals asked for."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from xlm.config import SpeculativeConfig
from xlm.worker.spec_decode.policy import SpeculationPolicy
from xlm.worker.spec_decode.proposers import Proposer, make_ngram_proposer


@dataclass
class Speculator:
    """A runner's proposer, its policy and the config they follow."""

    config: SpeculativeConfig
    proposer: Proposer
    policy: SpeculationPolicy

    @classmethod
    def of(cls, config: SpeculativeConfig, proposer: Proposer | None, bucket_of: Any) -> Speculator:
        """The config's proposer (prompt lookup unless one is given: a draft model's)."""
        proposer = proposer if proposer is not None else make_ngram_proposer(config)
        return cls(config, proposer, SpeculationPolicy(config, bucket_of))

    @staticmethod
    def write_proposals(
        batch: Any, req_ids: list[str], proposals: dict[str, list[int]]
    ) -> np.ndarray | None:
        """Put each request's scheduled proposals in its token row past its known tokens
        (where step_inputs reads them); their counts, or None without any."""
        if not proposals:
            return None
        spec_lens = np.zeros(len(req_ids), np.int32)
        for i, req_id in enumerate(req_ids):
            tokens = proposals.get(req_id)
            if tokens:
                slot = batch.requests[req_id].slot
                n = batch.num_tokens[slot]
                batch.token_ids[slot, n : n + len(tokens)] = tokens
                spec_lens[i] = len(tokens)
        return spec_lens

    def propose_after(self, step: Any, batch: Any) -> list[list[int]]:
        """The next proposals after a step (a StepInFlight) of the batch, timing it first:
        speculation turns async scheduling off, so dispatch to here is the step's time."""
        self.policy.record_step(step.bucket, time.perf_counter() - step.started)
        req_ids = [r if step.has_output[i] else "" for i, r in enumerate(step.req_ids)]
        return self.propose(batch, req_ids)

    def propose(self, batch: Any, req_ids: list[str]) -> list[list[int]]:
        """The next proposals of the requests that just sampled ("" for the others)."""
        return propose_for_batch(self.proposer, self.policy, self.config, batch, req_ids)


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
