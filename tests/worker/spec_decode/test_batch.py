"""The runner's speculation bookkeeping: scheduled proposals land past each request's
known tokens (the draft runner's rows: test_draft.py)."""

from xlm.sampling_params import SamplingParams
from xlm.worker.input_batch import CachedRequestState, InputBatch
from xlm.worker.spec_decode import Speculator


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
