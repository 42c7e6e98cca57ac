"""Scheduler rules: budget, caps, chunking, preemption, priority, stops, aborts, stats."""

import random

import pytest

from tests.core.sim import FakeModelRunner, check_invariants, make_request, run_to_completion
from xlm.config import CacheConfig, SchedulerConfig
from xlm.core.outputs import ModelRunnerOutput
from xlm.core.request import RequestStatus
from xlm.core.scheduler import Scheduler

BS = 4


def make_sched(
    num_blocks=64,
    budget=64,
    max_seqs=8,
    max_len=128,
    chunked=True,
    threshold=0,
    policy="fcfs",
    caching=True,
):
    sc = SchedulerConfig(budget, max_seqs, max_len, chunked, threshold, policy)
    return Scheduler(sc, CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks)


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def step(sched, runner):
    so = sched.schedule()
    check_invariants(sched, so)
    out = sched.update_from_output(so, runner.execute(so))
    check_invariants(sched)
    return so, out


def sample(sched, so, tokens_by_id):
    """Feed chosen tokens back for requests whose prefill is complete."""
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        done = req.num_computed_tokens == req.num_tokens
        sampled.append([tokens_by_id[rid]] if done else [])
    return ModelRunnerOutput(ids, sampled)


def test_generation_matches_across_budgets_and_chunking():
    results = []
    for budget, chunked, threshold in [
        (256, True, 0),
        (7, True, 0),
        (64, True, 5),
        (128, False, 0),
    ]:
        sched = make_sched(budget=budget, chunked=chunked, threshold=threshold)
        for i in range(6):
            sched.add_request(make_request(f"r{i}", prompt(i, 10 + 17 * i), max_tokens=9))
        results.append(run_to_completion(sched, FakeModelRunner(64, BS)))
    assert all(r == results[0] for r in results)
    assert all(len(toks) == 9 and reason == "length" for toks, reason, _ in results[0].values())


def test_chunked_prefill_respects_budget_and_mixes_with_decodes():
    sched = make_sched(budget=16)
    runner = FakeModelRunner(64, BS)
    sched.add_request(make_request("short", [1, 2, 3], max_tokens=20))
    step(sched, runner)
    sched.add_request(make_request("long", prompt(1, 50), max_tokens=2))
    chunks = []
    while "long" in sched.requests:
        so, _ = step(sched, runner)
        assert so.total_num_scheduled_tokens <= 16
        assert so.num_scheduled_tokens.get("short") == 1  # decodes keep going
        chunks.append(so.num_scheduled_tokens["long"])
    assert chunks[:4] == [15, 15, 15, 5] and sum(chunks[:4]) == 50


def test_long_prefill_token_threshold_caps_chunks():
    sched = make_sched(budget=64, threshold=8)
    runner = FakeModelRunner(64, BS)
    sched.add_request(make_request("a", prompt(2, 30), max_tokens=1))
    sizes = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        sizes.append(so.num_scheduled_tokens["a"])
    assert sizes == [8, 8, 8, 6]


def test_chunked_prefill_off_schedules_prompts_whole_with_head_of_line():
    sched = make_sched(budget=64, max_len=64, chunked=False)
    runner = FakeModelRunner(64, BS)
    for i in range(5):
        sched.add_request(make_request(f"d{i}", [i + 1, 2], max_tokens=30))
    step(sched, runner)
    sched.add_request(make_request("big", prompt(3, 60), max_tokens=2))
    sched.add_request(make_request("small", [7, 7], max_tokens=2))
    so, _ = step(sched, runner)
    # 5 decodes leave 59 < 60: big waits whole, and small waits behind it.
    assert set(so.num_scheduled_tokens) == {f"d{i}" for i in range(5)}
    while "big" in sched.requests and sched.requests["big"].status != RequestStatus.RUNNING:
        sched.finish_requests(sched.running[-1].request_id, RequestStatus.FINISHED_ABORTED)
        so, _ = step(sched, runner)
    assert so.num_scheduled_tokens["big"] == 60
    assert so.total_num_scheduled_tokens == 64  # 4 decodes + big: no room for small yet
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens["small"] == 2


def test_max_num_seqs_is_respected():
    sched = make_sched(max_seqs=3, budget=1000)
    seen_max = 0

    def on_step(_, so, __):
        nonlocal seen_max
        seen_max = max(seen_max, len(so.num_scheduled_tokens))
        assert len(sched.running) <= 3

    for i in range(10):
        sched.add_request(make_request(f"r{i}", prompt(i, 5), max_tokens=4))
    run_to_completion(sched, FakeModelRunner(64, BS), on_step=on_step)
    assert seen_max == 3


def test_never_fits_is_rejected_with_numbers():
    sched = make_sched(num_blocks=9, max_len=100)  # 8 usable blocks = 32 tokens
    with pytest.raises(ValueError, match="101 tokens.*max_model_len=100"):
        sched.add_request(make_request("a", [1] * 101))
    with pytest.raises(ValueError, match="33 tokens and needs 9 KV cache blocks.*only 8 blocks"):
        sched.add_request(make_request("b", [1] * 33))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("c", []))
    sched.add_request(make_request("d", [1] * 32, max_tokens=50))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("d", [1]))
    # A prompt filling the whole pool runs and is length-capped at the pool size.
    res = run_to_completion(sched, FakeModelRunner(9, BS))
    assert res["d"][1] == "length" and len(res["d"][0]) == 1
    assert not sched.has_unfinished_requests()


def test_request_growing_past_the_pool_is_length_capped_not_livelocked():
    sched = make_sched(num_blocks=5, max_len=1000)  # 16 tokens of cache
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=100))
    res = run_to_completion(sched, FakeModelRunner(5, BS), max_steps=100)
    assert res["a"][1] == "length" and len(res["a"][0]) == 13


def test_fcfs_preemption_victim_front_of_waiting_and_no_admission():
    # 6 usable blocks; three requests of 8 tokens take 2 blocks each.
    sched = make_sched(num_blocks=7)
    runner = FakeModelRunner(7, BS)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt(i, 8), max_tokens=10))
    so, _ = step(sched, runner)
    assert len(so.scheduled_new_reqs) == 3
    sched.add_request(make_request("late", [5], max_tokens=1))
    so, _ = step(sched, runner)
    # r0 needs a 3rd block: the latest running request (r2) is preempted.
    assert so.preempted_req_ids == {"r2"}
    assert sched.requests["r2"].status == RequestStatus.PREEMPTED
    assert list(sched.waiting)[0].request_id == "r2"
    assert "late" not in so.num_scheduled_tokens  # nothing admitted in a preempting step
    assert sched.requests["r2"].num_computed_tokens == 0
    assert sched.make_stats().num_preemptions == 1
    resumed = set()
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        c = so.scheduled_cached_reqs
        resumed |= {rid for rid, flag in zip(c.req_ids, c.resumed_from_preemption) if flag}
    assert "r2" in resumed and "r0" not in resumed


def _workload(sched, n=12, seed=0, **kw):
    rng = random.Random(seed)
    shared = prompt(99, 9)
    for i in range(n):
        body = shared + prompt(seed * 100 + i, rng.randrange(1, 20))
        sched.add_request(make_request(f"r{i}", body, max_tokens=rng.randrange(5, 40), **kw))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_and_resumption_match_uncontended_run(policy):
    big = make_sched(num_blocks=256, policy=policy)
    _workload(big)
    reference = run_to_completion(big, FakeModelRunner(256, BS))
    assert big.make_stats().num_preemptions == 0
    small = make_sched(num_blocks=20, budget=24, policy=policy)
    _workload(small)
    contended = run_to_completion(small, FakeModelRunner(20, BS))
    assert small.make_stats().num_preemptions > 0
    assert contended == reference


def test_priority_waiting_order():
    sched = make_sched(max_seqs=1, policy="priority")
    runner = FakeModelRunner(64, BS)
    sched.add_request(make_request("low", [1], priority=5, arrival_time=1.0, max_tokens=1))
    sched.add_request(make_request("high_late", [2], priority=0, arrival_time=3.0, max_tokens=1))
    sched.add_request(make_request("high_early", [3], priority=0, arrival_time=2.0, max_tokens=1))
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        order += [n.req_id for n in so.scheduled_new_reqs]
    assert order == ["high_early", "high_late", "low"]


def test_priority_preempts_lowest_priority_then_latest_arrival():
    sched = make_sched(num_blocks=9, policy="priority")  # 8 usable
    runner = FakeModelRunner(9, BS)
    specs = [("a", 0, 1.0), ("b", 9, 2.0), ("c", 9, 3.0), ("d", 1, 4.0)]
    for rid, prio, t in specs:
        n = 8 if rid == "a" else 6  # only a needs a third block in step 2
        sched.add_request(
            make_request(rid, prompt(ord(rid), n), priority=prio, arrival_time=t, max_tokens=30)
        )
    so, _ = step(sched, runner)
    assert len(so.scheduled_new_reqs) == 4 and sched.kv_cache_manager.usage == 1.0
    assert [r.request_id for r in sched.running] == ["a", "d", "b", "c"]
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"c"}  # lowest priority (9), latest arrival
    while "b" in sched.requests and not sched.requests["b"].num_preemptions:
        so, _ = step(sched, runner)
    assert sched.requests["a"].num_preemptions == 0
    assert sched.requests["d"].num_preemptions == 0


def test_stop_conditions_eos_min_tokens_stop_ids_ignore_eos():
    sched = make_sched()
    eos = 2
    sched.add_request(make_request("eos", [1, 1], eos=eos, min_tokens=2))
    sched.add_request(make_request("ign", [1, 1], eos=eos, ignore_eos=True, max_tokens=3))
    sched.add_request(make_request("stop", [1, 1], eos=eos, stop_token_ids=[7]))
    so = sched.schedule()
    script = {"eos": eos, "ign": eos, "stop": 7}
    out = {o.request_id: o for o in sched.update_from_output(so, sample(sched, so, script))}
    # min_tokens=2: the first EOS does not stop "eos".
    assert out["eos"].finish_reason is None and out["eos"].new_token_ids == [eos]
    assert out["ign"].finish_reason is None
    assert out["stop"].finish_reason == "stop" and out["stop"].stop_reason == 7
    assert "stop" in sched.finished_req_ids
    so = sched.schedule()
    assert "stop" in so.finished_req_ids
    out = {o.request_id: o for o in sched.update_from_output(so, sample(sched, so, script))}
    assert out["eos"].finish_reason == "stop" and out["eos"].stop_reason is None
    assert out["ign"].finish_reason is None
    so = sched.schedule()
    out = {o.request_id: o for o in sched.update_from_output(so, sample(sched, so, script))}
    assert out["ign"].finish_reason == "length" and out["ign"].new_token_ids == [eos]
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_max_model_len_caps_generation():
    sched = make_sched(max_len=10)
    sched.add_request(make_request("a", [1] * 7, max_tokens=100))
    res = run_to_completion(sched, FakeModelRunner(64, BS))
    assert res["a"][1] == "length" and len(res["a"][0]) == 3


def test_multiple_tokens_per_step_truncate_at_stop():
    sched = make_sched()
    sched.add_request(make_request("a", [1, 2], eos=9, max_tokens=10))
    so = sched.schedule()
    out = sched.update_from_output(so, ModelRunnerOutput(["a"], [[4, 9, 5]]))
    assert out[0].new_token_ids == [4, 9] and out[0].finish_reason == "stop"


def test_abort_waiting_and_running_frees_everything():
    sched = make_sched(max_seqs=2)
    runner = FakeModelRunner(64, BS)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt(i, 9), max_tokens=50))
    so = sched.schedule()
    sched.finish_requests(["r0", "r3", "unknown"], RequestStatus.FINISHED_ABORTED)
    # The step already scheduled r0: its output is dropped.
    out = sched.update_from_output(so, runner.execute(so))
    assert [o.request_id for o in out] == ["r1"]
    check_invariants(sched)
    so = sched.schedule()
    assert {"r0", "r3"} <= so.finished_req_ids
    assert "r2" in so.num_scheduled_tokens
    sched.update_from_output(so, runner.execute(so))
    sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(["r2"], RequestStatus.FINISHED_STOPPED)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    with pytest.raises(ValueError):
        sched.finish_requests("r1", RequestStatus.RUNNING)


def test_samples_of_one_prompt_share_it_in_the_same_step():
    sched = make_sched()
    p = prompt(5, 13)
    for i in range(4):
        sched.add_request(make_request(f"s{i}", p, max_tokens=3))
    so = sched.schedule()
    hits = [n.num_computed_tokens for n in so.scheduled_new_reqs]
    assert hits == [0, 12, 12, 12]
    tables = [n.block_ids for n in so.scheduled_new_reqs]
    assert all(t[:3] == tables[0][:3] for t in tables)
    out = sched.update_from_output(so, FakeModelRunner(64, BS).execute(so))
    assert [o.num_cached_tokens for o in out] == [0, 12, 12, 12]
    stats = sched.make_stats()
    assert stats.prefix_cache_queries == 52 and stats.prefix_cache_hits == 36
    assert stats.prefix_cache_hit_rate == pytest.approx(36 / 52)


def test_logprobs_pass_through():
    sched = make_sched()
    sched.add_request(make_request("a", [1, 2], max_tokens=1))
    so = sched.schedule()
    out = sched.update_from_output(
        so, ModelRunnerOutput(["a"], [[3]], logprobs=["LP"], prompt_logprobs={"a": "PLP"})
    )
    assert out[0].new_logprobs == "LP" and out[0].new_prompt_logprobs == "PLP"
    assert out[0].finish_reason == "length"


def test_stats_and_reset_prefix_cache():
    sched = make_sched()
    sched.add_request(make_request("a", prompt(1, 9), max_tokens=2))
    sched.add_request(make_request("b", prompt(2, 9), max_tokens=2))
    runner = FakeModelRunner(64, BS)
    step(sched, runner)
    stats = sched.make_stats()
    assert stats.num_running_reqs == 2 and stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == pytest.approx(6 / 63)
    assert stats.num_steps == 1 and stats.step_num_scheduled_tokens == 18
    assert sched.reset_prefix_cache() is False
    run_to_completion(sched, runner)
    assert sched.reset_prefix_cache() is True
    assert sched.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("seed", range(6))
def test_randomized_workloads_leak_no_blocks(seed):
    rng = random.Random(seed)
    policy = rng.choice(["fcfs", "priority"])
    num_blocks = rng.randrange(12, 40)
    sched = make_sched(
        num_blocks=num_blocks,
        budget=rng.randrange(8, 40),
        max_seqs=rng.randrange(1, 8),
        policy=policy,
    )
    runner = FakeModelRunner(num_blocks, BS, vocab=50)
    shared = prompt(seed, 12)
    n = 0
    for _ in range(300):
        if rng.random() < 0.3:
            body = (shared[: rng.randrange(13)] if rng.random() < 0.5 else []) + prompt(
                rng.random(), rng.randrange(1, 20)
            )
            sched.add_request(
                make_request(
                    f"r{n}",
                    body,
                    eos=0,
                    priority=rng.randrange(3),
                    arrival_time=float(n),
                    max_tokens=rng.randrange(1, 30),
                )
            )
            n += 1
        if sched.requests and rng.random() < 0.1:
            victim = rng.choice(list(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        if sched.has_unfinished_requests():
            step(sched, runner)
    run_to_completion(sched, runner)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1
    assert sched.kv_cache_manager.groups[0].req_to_blocks == {}


def test_no_admission_in_a_step_that_preempted():
    # Priority policy so the newcomer is at the head of waiting, ahead of the victim.
    sched = make_sched(num_blocks=5, policy="priority")  # 4 usable
    runner = FakeModelRunner(5, BS)
    sched.add_request(make_request("a", [1, 2, 3, 4], priority=0, arrival_time=1.0))
    sched.add_request(make_request("v", prompt(8, 8), priority=5, arrival_time=2.0))
    sched.add_request(make_request("c", [5, 6], priority=0, arrival_time=3.0))
    so, _ = step(sched, runner)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    sched.add_request(make_request("late", [9], priority=0, arrival_time=4.0))
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"v"}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 1  # room, but...
    assert "late" not in so.num_scheduled_tokens  # ...no admissions in a preempting step
    so, _ = step(sched, runner)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["late"]


def test_resumed_request_carries_its_outputs_and_whole_table():
    sched = make_sched(num_blocks=7)
    runner = FakeModelRunner(7, BS)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt(i, 8), max_tokens=10))
    step(sched, runner)
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"r2"}
    outputs_at_preemption = list(sched.requests["r2"].output_token_ids)
    while True:
        so, _ = step(sched, runner)
        c = so.scheduled_cached_reqs
        if "r2" in c.req_ids:
            break
    i = c.req_ids.index("r2")
    assert c.resumed_from_preemption[i]
    assert c.new_token_ids[i] == outputs_at_preemption
    assert c.new_block_ids[i] == sched.kv_cache_manager.get_block_ids("r2")
    req = sched.requests["r2"]
    assert c.num_computed_tokens[i] + so.num_scheduled_tokens["r2"] == req.num_computed_tokens
    assert req.num_computed_tokens == req.num_tokens - 1  # resumed whole, then sampled


def test_threshold_ignored_without_chunked_prefill():
    sched = make_sched(budget=128, chunked=False, threshold=4)
    sched.add_request(make_request("a", prompt(1, 30)))
    assert sched.schedule().num_scheduled_tokens == {"a": 30}


def test_priority_victim_is_low_priority_even_if_admitted_first():
    sched = make_sched(num_blocks=5, policy="priority")  # 4 usable
    runner = FakeModelRunner(5, BS)
    sched.add_request(make_request("b", prompt(1, 6), priority=9, arrival_time=1.0))
    step(sched, runner)
    sched.add_request(make_request("a", prompt(2, 8), priority=0, arrival_time=2.0))
    step(sched, runner)
    assert [r.request_id for r in sched.running] == ["a", "b"]  # scheduling order
    so, _ = step(sched, runner)  # a needs a third block
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}


def test_a_step_covers_no_more_images_than_the_encoder_cache_holds():
    import numpy as np

    from xlm.core.step_plan import ImageRule
    from xlm.multimodal.inputs import MultiModalFeature

    sched = make_sched(budget=64)
    sched.image_rule = ImageRule(cap=2)
    # Three 8-token images at 4, 16 and 28 in a 40-token prompt: the chunk stops before
    # the third image's placeholders, and the next step covers it.
    request = make_request("r", prompt(0, 40), max_tokens=1)
    pixels = np.zeros((3, 1, 1), np.float32)
    request.mm_features = [
        MultiModalFeature("image", f"img{i}", off, 8, pixels) for i, off in enumerate((4, 16, 28))
    ]
    sched.add_request(request)
    first = sched.schedule()
    assert first.num_scheduled_tokens["r"] == 28
    assert first.scheduled_new_reqs[0].mm_features is request.mm_features
    sched.update_from_output(first, ModelRunnerOutput(["r"], [[]]))
    second = sched.schedule()
    assert second.num_scheduled_tokens["r"] == 12
