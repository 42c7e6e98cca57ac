"""Step inputs: the InputBatch's rows of one step -> the padded ragged arrays on the host.

A step of T tokens over R requests is padded up to its token bucket (and R to the rows of
that bucket); padding tokens write to the null block. Tokens the host does not know yet
(async scheduling: sampled by the step still in flight) are marked in ``prev_src`` with
the row of that step's sampler output the program reads them from.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from xlm.core.outputs import SchedulerOutput
from xlm.ops.paged_attention import AttentionMetadata
from xlm.worker.buckets import Buckets
from xlm.worker.input_batch import InputBatch


def prepare_inputs(
    batch: InputBatch,
    buckets: Buckets,
    block_size: int,
    prev_rows: dict[str, int],
    step_count: int,
    req_ids: list[str],
    num_scheduled: list[int],
    num_tokens_padded: int,
    so: SchedulerOutput | None = None,
) -> tuple[dict[str, Any], Any, np.ndarray]:
    """Build the padded ragged batch; returns the arrays, the sampling rows and which
    requests sample this step.

    ``prev_rows`` maps each request that sampled in the step in flight to its sampler
    row there; ``step_count`` seeds unseeded requests' random keys.
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
    unknown = np.flatnonzero(positions[:total] >= batch.num_tokens[token_slots])
    if unknown.size:
        prev_src[unknown] = [prev_rows[req_ids[r]] for r in req_of_token[unknown]]
    seq_lens = np.zeros(num_reqs_padded, dtype=np.int32)
    seq_lens[:num_reqs] = computed + counts
    attn = _attention_metadata(
        batch, block_size, slots, token_slots, positions, total, cu, seq_lens, num_reqs
    )
    logits_indices = np.zeros(num_reqs_padded, dtype=np.int32)
    logits_indices[:num_reqs] = cu[1 : num_reqs + 1] - 1
    # A request samples when this step computes its last known token.
    samples = seq_lens[:num_reqs] >= batch.num_tokens[slots]
    rows = buckets.sampler_bucket(num_reqs_padded)
    sampling = batch.sampling_metadata(slots, rows, step_count, _grammar_rows(req_ids, so))
    if unknown.size:
        # Those requests' sampling counts the token in flight too (a seeded row's
        # random key folds in its output length).
        sampling.output_lens[req_of_token[unknown]] += 1
    inputs = {
        "input_ids": input_ids,
        "prev_src": prev_src,
        "attn": attn,
        "logits_indices": logits_indices,
    }
    return inputs, sampling, samples


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


def _grammar_rows(req_ids: list[str], so: SchedulerOutput | None) -> dict[int, Any] | None:
    """Structured-output bitmask rows (from the scheduler) by position in this step."""
    if so is None or not so.structured_output_request_ids:
        return None
    row_of = {r: i for i, r in enumerate(req_ids)}
    ids = so.structured_output_request_ids
    return {row_of[r]: so.grammar_bitmask[i] for i, r in enumerate(ids)}
