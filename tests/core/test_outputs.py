"""Records between layers: logprob rows, finished outputs, derived scheduler rates."""

import numpy as np

from xlm.core.outputs import CachedRequestData, EngineCoreOutput, LogprobsLists, SchedulerStats


def test_logprobs_rows_put_the_chosen_token_first():
    rows = LogprobsLists.from_sampler(
        np.array([5, 6]),
        np.array([-0.5, -1.0], np.float32),
        np.array([1, 2]),
        np.array([[5, 9], [7, 6]]),
        np.array([[-0.5, -2.0], [-0.25, -1.0]], np.float32),
    )
    assert rows.logprob_token_ids == [[5, 5, 9], [6, 7, 6]]
    assert rows.logprobs == [[-0.5, -0.5, -2.0], [-1.0, -0.25, -1.0]]
    assert rows.sampled_token_ranks == [1, 2]
    assert all(type(t) is int for row in rows.logprob_token_ids for t in row)


def test_an_output_is_finished_when_it_has_a_reason():
    assert not EngineCoreOutput("a", [1]).finished
    assert EngineCoreOutput("a", [1], "length").finished
    assert CachedRequestData(req_ids=["a", "b"]).num_reqs == 2


def test_rates_are_zero_before_anything_is_counted():
    idle = SchedulerStats()
    assert idle.spec_acceptance_rate == idle.spec_mean_accepted_length == 0.0
    assert idle.prefix_cache_hit_rate == 0.0
    busy = SchedulerStats(
        prefix_cache_queries=40,
        prefix_cache_hits=10,
        spec_num_drafts=4,
        spec_num_draft_tokens=16,
        spec_num_accepted_tokens=8,
    )
    assert busy.prefix_cache_hit_rate == 0.25
    assert busy.spec_acceptance_rate == 0.5
    assert busy.spec_mean_accepted_length == 3.0  # 2 accepted per draft + the sampled one
