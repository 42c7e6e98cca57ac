"""Prompt logprobs: which positions of a step to score, and scoring them in fixed chunks.

A request that asked for prompt logprobs gets, per prompt chunk the step computed, the
logprobs of each next prompt token (and the top-k) from the step's hidden states. The
positions go through one compiled program of PROMPT_LOGPROB_ROWS rows, chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from xlm.core.outputs import LogprobsLists
from xlm.distributed.mesh import to_host
from xlm.worker.input_batch import InputBatch

# Prompt positions scored per call of the prompt-logprobs program (one compiled shape).
PROMPT_LOGPROB_ROWS = 128


@dataclass
class PromptLogprobsPlan:
    """Rows of the step's hidden states to score, their target tokens, and per request
    (first row, row count, top-k)."""

    rows: list[int]
    targets: list[int]
    spans: dict[str, tuple[int, int, int]]


def plan(batch: InputBatch, req_ids: list[str], num_scheduled: list[int]) -> PromptLogprobsPlan:
    """Positions of this step whose next token is a prompt token, for requests that asked.

    Call before the batch counts the step's tokens as computed; marks them as done.
    """
    rows: list[int] = []
    targets: list[int] = []
    spans: dict[str, tuple[int, int, int]] = {}
    offset = 0
    for req_id, n in zip(req_ids, num_scheduled):
        state = batch.requests[req_id]
        k = state.sampling_params.prompt_logprobs
        computed = int(batch.num_computed_tokens[state.slot])  # before this step
        if k is not None:
            # Positions p in this chunk whose next token is still a prompt token (and
            # not already scored before a preemption).
            start = max(computed, state.num_prompt_logprobs_done)
            stop = min(computed + n, len(state.prompt_token_ids) - 1)
            if stop > start:
                spans[req_id] = (len(rows), stop - start, k)
                first_row = offset + start - computed
                rows.extend(range(first_row, first_row + stop - start))
                targets.extend(state.prompt_token_ids[start + 1 : stop + 1])
                state.num_prompt_logprobs_done = stop
        offset += n
    return PromptLogprobsPlan(rows, targets, spans)


def compute(
    work: PromptLogprobsPlan,
    hidden: jax.Array,
    run: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, ...]],
) -> dict[str, LogprobsLists] | None:
    """Score the planned rows of `hidden` [T, H]; `run(hidden_chunk, ids)` runs the
    program on PROMPT_LOGPROB_ROWS rows and returns (logprobs, ranks, top ids, top lps)."""
    if not work.rows:
        return None
    chunk = PROMPT_LOGPROB_ROWS
    hidden_rows = to_host(hidden)[work.rows]
    targets = work.targets
    results = []
    for i in range(0, len(work.rows), chunk):
        h = np.zeros((chunk, hidden_rows.shape[1]), hidden_rows.dtype)
        ids = np.zeros(chunk, np.int32)
        part = hidden_rows[i : i + chunk]
        h[: len(part)] = part
        ids[: len(part)] = targets[i : i + chunk]
        results.append(run(h, ids))
    lp, ranks, top_ids, top_lps = (
        np.concatenate(parts)[: len(work.rows)] for parts in zip(*results)
    )
    out = {}
    for req_id, (first, count, k) in work.spans.items():
        sl = slice(first, first + count)
        out[req_id] = LogprobsLists.from_sampler(
            targets[sl], lp[sl], ranks[sl], top_ids[sl, :k], top_lps[sl, :k]
        )
    return out
