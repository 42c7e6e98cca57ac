"""StepPlan: requests the runner already holds go out as parallel rows."""

from xlm.core.step_plan import ImageRule, StepPlan


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


def test_whole_images_are_never_cut_by_a_chunk():
    from types import SimpleNamespace

    from xlm.multimodal.inputs import MultiModalFeature

    image = MultiModalFeature("image", "h", 10, 8, None)  # positions [10, 18)
    request = SimpleNamespace(mm_features=[image])
    # Cut inside the image: the chunk stops before it (whole) or keeps it (LLaVA).
    assert StepPlan(64).fit_images(request, 0, 14, ImageRule(4, whole=True)) == 10
    assert StepPlan(64).fit_images(request, 0, 14, ImageRule(4)) == 14
    # The image fits, or its rest does (a prefix hit ended inside it).
    assert StepPlan(64).fit_images(request, 0, 18, ImageRule(4, whole=True)) == 18
    assert StepPlan(64).fit_images(request, 12, 6, ImageRule(4, whole=True)) == 6
    assert StepPlan(64).fit_images(request, 12, 5, ImageRule(4, whole=True)) == 0
