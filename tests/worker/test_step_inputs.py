"""A step's padded ragged arrays, built from the InputBatch, against a per-token loop."""

import numpy as np

from xlm.sampling_params import SamplingParams
from xlm.worker.buckets import Buckets
from xlm.worker.input_batch import CachedRequestState, InputBatch
from xlm.worker.step_inputs import prepare_inputs

BS, V, L = 4, 40, 16


def test_prefill_decode_and_in_flight_token_match_a_per_token_loop():
    batch = InputBatch(4, L, 4, V)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    # "a": 6-token prompt, nothing computed; "b": decoding its 4th token; "c": its
    # last token is still being sampled by the step in flight (async scheduling).
    reqs = {
        "a": ([1, 2, 3, 4, 5, 6], [5, 6], 0, 6),
        "b": ([7, 8, 9, 10], [2], 3, 1),
        "c": ([11, 12, 13], [3, 1], 3, 1),
    }
    for rid, (prompt, blocks, computed, _) in reqs.items():
        batch.add(CachedRequestState(rid, list(prompt), greedy), blocks, computed)
    req_ids = list(reqs)
    counts = [reqs[r][3] for r in req_ids]
    buckets = Buckets((4, 16), (1, 4), max_num_seqs=4)
    step = prepare_inputs(batch, buckets, BS, {"c": 2}, 0, req_ids, counts, 16)
    inputs, sampling = step.arrays, step.sampling
    want_ids, want_pos, want_slot, want_src = [], [], [], []
    for prompt, blocks, computed, n in reqs.values():
        for p in range(computed, computed + n):
            want_pos.append(p)
            want_ids.append(prompt[p] if p < len(prompt) else 0)
            want_slot.append(blocks[p // BS] * BS + p % BS)
            want_src.append(2 if p >= len(prompt) else -1)
    pad = 16 - len(want_pos)
    attn = inputs["attn"]
    np.testing.assert_array_equal(inputs["input_ids"], want_ids + [0] * pad)
    np.testing.assert_array_equal(attn.positions, want_pos + [0] * pad)
    np.testing.assert_array_equal(attn.slot_mapping, want_slot + [0] * pad)  # pad: null block
    np.testing.assert_array_equal(inputs["prev_src"], want_src + [-1] * pad)
    np.testing.assert_array_equal(attn.query_start_loc, [0, 6, 7, 8, 8])
    np.testing.assert_array_equal(attn.seq_lens, [6, 4, 4, 0])
    np.testing.assert_array_equal(inputs["logits_indices"], [5, 6, 7, 0])
    assert inputs["num_logit_rows"].tolist() == [3]  # the real rows, first in the indices
    np.testing.assert_array_equal(attn.block_tables[:3, :2], [[5, 6], [2, 0], [3, 1]])
    assert int(attn.num_seqs[0]) == 3
    assert step.has_output.tolist() == [True, True, True]
    assert (step.shape.sampler_rows, step.shape.few_rows) == (4, False)
    # "c" counts its in-flight token among its outputs; the others have none yet.
    assert np.asarray(sampling.output_lens)[:3].tolist() == [0, 0, 1]


def test_chunked_prefill_does_not_sample():
    batch = InputBatch(2, L, 4, V)
    batch.add(CachedRequestState("a", list(range(1, 10)), SamplingParams()), [1, 2, 3], 0)
    buckets = Buckets((4, 16), (1, 4), max_num_seqs=2)
    step = prepare_inputs(batch, buckets, BS, {}, 0, ["a"], [4], 4)
    inputs = step.arrays
    assert step.has_output.tolist() == [False]
    np.testing.assert_array_equal(inputs["attn"].slot_mapping, [4, 5, 6, 7])
    np.testing.assert_array_equal(inputs["prev_src"], [-1] * 4)
