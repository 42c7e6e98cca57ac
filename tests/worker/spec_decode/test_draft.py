"""The draft runner's cached rows split by step: the rows that run in it, and the rest."""

from xlm.core.outputs import CachedRequestData
from xlm.worker.spec_decode.draft import _rows_in_step, _rows_not_in_step


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
