"""Step inputs: the InputBatch's rows of one step -> the padded ragged arrays on the host.

A step of T tokens over R requests is padded up to its token bucket (and R to the rows of
that bucket); padding tokens write to the null block. Tokens the host does not know yet
(async scheduling: sampled by the step still in flight) are marked in ``prev_src`` with
the row of that step's sampler output the program reads them from.

With speculative decoding a request's proposed tokens sit in its token row past its
known tokens (``spec_lens`` of them) and are computed like known ones; it then has one
logit row per proposed token plus one (xlm.worker.sampler verifies them), so logit rows
follow requests' token spans rather than one per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xlm.core.outputs import SchedulerOutput
from xlm.ops.paged_attention import AttentionMetadata
from xlm.worker.buckets import Buckets, StepShape
from xlm.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    """One step's padded host arrays and what the runner needs to read its results."""

    arrays: dict[str, Any]  # the model program's inputs
    sampling: Any  # the sampler's rows (SamplingMetadata)
    has_output: np.ndarray  # per request: whether this step makes its token (or vector)
    row_counts: np.ndarray  # logit rows per request, in order (several when verifying)
    shape: StepShape


def prepare_inputs(
    batch: InputBatch,
    buckets: Buckets,
    block_size: int,
    prev_rows: dict[str, int],
    sampling_key: int,
    req_ids: list[str],
    num_scheduled: list[int],
    num_tokens_padded: int,
    scheduler_output: SchedulerOutput | None = None,
    spec_lens: np.ndarray | None = None,
    lora_slots: np.ndarray | None = None,
) -> StepInputs:
    """Build the padded ragged batch of a step.

    ``prev_rows`` maps each request that sampled in the step in flight to its sampler
    row there; ``sampling_key`` seeds unseeded requests' random keys. ``lora_slots``
    (LoRA on): each request's adapter slot (0: none), spread over its tokens.
    """
    num_reqs = len(req_ids)
    num_reqs_padded = buckets.rows_for_tokens(num_tokens_padded)
    slots = batch.slots(req_ids)
    counts = np.asarray(num_scheduled, dtype=np.int32)
    total = int(counts.sum())
    cu = np.zeros(num_reqs_padded + 1, dtype=np.int32)
    np.cumsum(counts, out=cu[1 : num_reqs + 1])
    cu[num_reqs + 1 :] = total
    computed = batch.num_computed_tokens[slots]
    req_of_token = np.repeat(np.arange(num_reqs), counts)
    positions = np.zeros(num_tokens_padded, dtype=np.int32)
    positions[:total] = computed[req_of_token] + (np.arange(total) - cu[req_of_token])
    token_slots = slots[req_of_token]
    input_ids = np.zeros(num_tokens_padded, dtype=np.int32)
    input_ids[:total] = batch.token_ids[token_slots, positions[:total]]
    # Tokens past what the host knows were sampled by the step in flight: the program
    # reads them from its output row (-1: the host's token).
    prev_src = np.full(num_tokens_padded, -1, dtype=np.int32)
    known = batch.num_tokens[token_slots]
    if spec_lens is not None:
        known = known + spec_lens[req_of_token]
    unknown = np.flatnonzero(positions[:total] >= known)
    if unknown.size:
        prev_src[unknown] = [prev_rows[req_ids[r]] for r in req_of_token[unknown]]
    seq_lens = np.zeros(num_reqs_padded, dtype=np.int32)
    seq_lens[:num_reqs] = computed + counts
    attn = _attention_metadata(
        batch, block_size, slots, token_slots, positions, total, cu, seq_lens, num_reqs
    )
    # A request has its output when this step computes its last known token.
    has_output = seq_lens[:num_reqs] >= batch.num_tokens[slots]
    logits_indices = np.zeros(buckets.logit_rows_for_tokens(num_tokens_padded), np.int32)
    row_counts, row_slots, drafts = _logit_rows(batch, slots, cu, spec_lens, logits_indices)
    shape = buckets.step_shape(num_tokens_padded, int(row_counts.sum()))
    grammar = _grammar_rows(req_ids, scheduler_output, row_counts)
    sampling = batch.sampling_metadata(row_slots, shape.sampler_rows, sampling_key, grammar, drafts)
    if unknown.size:
        # Those requests' sampling counts the token in flight too (a seeded row's
        # random key folds in its output length; async scheduling has no proposals, so
        # one row per request).
        sampling.output_lens[req_of_token[unknown]] += 1
    inputs = {
        "input_ids": input_ids,
        "prev_src": prev_src,
        "attn": attn,
        "logits_indices": logits_indices,
        # Real rows of logits_indices (they come first): the program skips the LM head
        # for the padding when there are few (programs.lm_head_logits).
        "num_logit_rows": np.array([int(row_counts.sum())], np.int32),
    }
    if lora_slots is not None:
        token_lora = np.zeros(num_tokens_padded, dtype=np.int32)  # padding: no adapter
        token_lora[:total] = lora_slots[req_of_token]
        inputs["lora_slots"] = token_lora
    return StepInputs(inputs, sampling, has_output, row_counts, shape)


def _logit_rows(
    batch: InputBatch,
    slots: np.ndarray,
    cu: np.ndarray,
    spec_lens: np.ndarray | None,
    logits_indices: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """Fill `logits_indices` with each request's logit rows; returns the rows per request,
    each row's batch slot and, when verifying proposals, each row's draft token and offset."""
    num_reqs = len(slots)
    ends = cu[1 : num_reqs + 1] - 1
    if spec_lens is None or not spec_lens.any():
        logits_indices[:num_reqs] = ends
        return np.ones(num_reqs, np.int32), slots, None
    # Rows of request r: its last spec_lens[r] + 1 tokens' logits; row j verifies the
    # proposal at position num_tokens + j (none on the last row).
    row_counts = (spec_lens + 1).astype(np.int32)
    num_rows = int(row_counts.sum())
    row_req = np.repeat(np.arange(num_reqs), row_counts)
    row_start = np.zeros(num_reqs, np.int32)
    np.cumsum(row_counts[:-1], out=row_start[1:])
    offsets = np.arange(num_rows, dtype=np.int32) - row_start[row_req]
    logits_indices[:num_rows] = ends[row_req] - spec_lens[row_req] + offsets
    row_slots = slots[row_req]
    next_pos = np.minimum(batch.num_tokens[row_slots] + offsets, batch.max_model_len - 1)
    draft_ids = np.where(
        offsets < spec_lens[row_req], batch.token_ids[row_slots, next_pos], -1
    ).astype(np.int32)
    return row_counts, row_slots, (draft_ids, offsets)


def _attention_metadata(
    batch: InputBatch,
    block_size: int,
    slots: np.ndarray,
    token_slots: np.ndarray,
    positions: np.ndarray,
    total: int,
    cu: np.ndarray,
    seq_lens: np.ndarray,
    num_reqs: int,
) -> AttentionMetadata:
    """Slot mapping and block tables of the step, padded like positions and seq_lens."""
    # With KV cache groups the tables carry a leading group axis ([G, ...]).
    tables = batch.block_table
    groups = tables.shape[:-2]
    num_tokens_padded, num_reqs_padded = len(positions), len(seq_lens)
    slot_mapping = np.zeros((*groups, num_tokens_padded), dtype=np.int32)  # pad: null block
    pos = positions[:total]
    slot_mapping[..., :total] = (
        tables[..., token_slots, pos // block_size] * block_size + pos % block_size
    )
    block_tables = np.zeros((*groups, num_reqs_padded, tables.shape[-1]), np.int32)
    block_tables[..., :num_reqs, :] = tables[..., slots, :]
    return AttentionMetadata(
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=cu,
        seq_lens=seq_lens,
        block_tables=block_tables,
        num_seqs=np.array([num_reqs], dtype=np.int32),
    )


def _grammar_rows(
    req_ids: list[str], scheduler_output: SchedulerOutput | None, row_counts: np.ndarray
) -> dict[int, Any] | None:
    """Structured-output bitmask rows (from the scheduler) by sampler row of this step
    (a constrained request is proposed nothing: one row)."""
    if scheduler_output is None or not scheduler_output.structured_output_request_ids:
        return None
    starts = np.concatenate(([0], np.cumsum(row_counts)[:-1]))
    row_of = {r: int(starts[i]) for i, r in enumerate(req_ids)}
    ids = scheduler_output.structured_output_request_ids
    return {row_of[r]: scheduler_output.grammar_bitmask[i] for i, r in enumerate(ids)}
