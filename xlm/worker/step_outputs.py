"""A dispatched step in flight, and its sampled tokens read back into the batch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from xlm.core.outputs import LogprobsLists
from xlm.distributed.mesh import to_host
from xlm.worker import prompt_logprobs
from xlm.worker import sampler as sampler_lib
from xlm.worker.input_batch import InputBatch


@dataclass
class StepInFlight:
    """A dispatched step whose results have not reached the host yet."""

    req_ids: list[str]
    has_output: np.ndarray  # per request: whether this step makes its token (or vector)
    sampled: sampler_lib.SamplerOutput | None = None  # device arrays (None: pooling)
    hidden: jax.Array | None = None  # kept only when prompt logprobs read it
    prompt_plan: prompt_logprobs.PromptLogprobsPlan | None = None
    pooled: jax.Array | None = None  # pooling runner: [rows, hidden] vectors (device)
    # Sampler rows per request (several with speculative decoding), in order.
    row_counts: np.ndarray | None = None
    # Speculative decoding: proposals verified per request, the step's token bucket and
    # when it was dispatched (the policy times steps by bucket).
    spec_lens: np.ndarray | None = None
    bucket: int = 0
    started: float = 0.0


def read_sampled(
    step: StepInFlight, batch: InputBatch, policy: Any = None
) -> tuple[list[list[int]], list[LogprobsLists | None] | None]:
    """Each request's new tokens (and logprobs, None when none asked) from the step's
    sampler output, appended to its row in the batch; with speculative decoding the
    policy (xlm.worker.spec_decode) records how many proposals each request had accepted."""
    # Only the arrays this step's requests use come to the host: the tokens; whether
    # proposals were accepted with speculative decoding; the logprobs where a request
    # asked for them.
    device = step.sampled
    wanted = ["sampled_token_ids"]
    verifying = step.row_counts is not None and bool((step.row_counts > 1).any())
    if verifying:
        wanted.append("accepted")
    if any(
        (state := batch.requests.get(r)) is not None and state.sampling_params.logprobs is not None
        for r in step.req_ids
    ):
        wanted += ["logprobs", "ranks", "topk_ids", "topk_logprobs"]
    sampled = dataclasses.replace(device, **to_host({n: getattr(device, n) for n in wanted}))
    token_ids = np.asarray(sampled.sampled_token_ids)
    accepted = np.asarray(sampled.accepted) if verifying else None
    sampled_token_ids: list[list[int]] = []
    logprobs: list[LogprobsLists | None] = []
    row = 0
    for i, req_id in enumerate(step.req_ids):
        first = row
        row += 1 if step.row_counts is None else int(step.row_counts[i])
        if not step.has_output[i]:
            sampled_token_ids.append([])
            logprobs.append(None)
            continue
        # Accepted proposals, then the first row's own token that was not one (the
        # correction, or the bonus token after all were accepted).
        last = first
        while last < row - 1 and accepted[last]:
            last += 1
        tokens = token_ids[first : last + 1].tolist()
        sampled_token_ids.append(tokens)
        state = batch.requests.get(req_id)
        if step.spec_lens is not None and step.spec_lens[i] and state is not None:
            policy.record_verification(state, int(step.spec_lens[i]), last - first)
        # Finished (forgotten) or preempted since the dispatch: the scheduler decides;
        # a resumed request gets its outputs anew.
        if state is not None and state.slot >= 0:
            for token in tokens:
                batch.append_sampled(state, token)
        num_logprobs = state.sampling_params.logprobs if state is not None else None
        end = last + 1
        logprobs.append(
            None
            if num_logprobs is None
            else LogprobsLists.from_sampler(
                tokens,
                sampled.logprobs[first:end],
                sampled.ranks[first:end],
                sampled.topk_ids[first:end, :num_logprobs],
                sampled.topk_logprobs[first:end, :num_logprobs],
            )
        )
    return sampled_token_ids, logprobs if any(lp is not None for lp in logprobs) else None
