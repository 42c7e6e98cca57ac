"""StepPlan: requests the runner already holds go out as parallel rows."""

from xlm.core.step_plan import StepPlan


def test_cached_requests_are_added_as_aligned_rows():
    plan = StepPlan(token_budget=64)
    plan.add_cached("a", False, [3], 8, [])
    plan.add_cached("b", True, ([1, 2], [4]), 0, [9, 10])
    cached = plan.cached
    assert cached.req_ids == ["a", "b"] and cached.num_reqs == 2
    assert cached.resumed_from_preemption == [False, True]
    assert cached.new_block_ids == [[3], ([1, 2], [4])]
    assert cached.num_computed_tokens == [8, 0]
    assert cached.new_token_ids == [[], [9, 10]]
    assert plan.token_budget == 64 and not plan.new_reqs and not plan.scheduled
