"""The runner's speculation bookkeeping: scheduled proposals land past each request's
known tokens, and the draft runner's cached rows split by step."""

from xlm.core.outputs import CachedRequestData
from xlm.sampling_params import SamplingParams
from xlm.worker.input_batch import CachedRequestState, InputBatch
from xlm.worker.spec_decode import Speculator
from xlm.worker.spec_decode.draft import _rows_in_step, _rows_not_in_step


def test_proposals_are_written_past_the_known_tokens():
    batch = InputBatch(4, 16, 4, 40)
    for req_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5])):
        batch.add(CachedRequestState(req_id, prompt, SamplingParams()), [1], 0)
    assert Speculator.write_proposals(batch, ["a", "b"], {}) is None
    spec_lens = Speculator.write_proposals(batch, ["a", "b"], {"b": [7, 8]})
    assert spec_lens.tolist() == [0, 2]
    slot_a, slot_b = batch.requests["a"].slot, batch.requests["b"].slot
    assert batch.token_ids[slot_b, :4].tolist() == [4, 5, 7, 8]
    assert batch.token_ids[slot_a, :3].tolist() == [1, 2, 3]
    assert int(batch.num_tokens[slot_b]) == 2  # proposals are not known tokens


def test_cached_rows_split_into_this_step_and_the_rest():
    cached = CachedRequestData(["a", "b", "c"], [True, False, True], [[1], [2], [3]], [4, 5, 6])
    cached.new_token_ids = [[10], [], [30]]
    step = {"a": 1, "c": 2}
    now, later = _rows_in_step(cached, step), _rows_not_in_step(cached, step)
    assert (now.req_ids, now.num_computed_tokens, now.new_token_ids) == (
        ["a", "c"],
        [4, 6],
        [[10], [30]],
    )
    assert (later.req_ids, later.resumed_from_preemption, later.new_block_ids) == (
        ["b"],
        [False],
        [[2]],
    )
