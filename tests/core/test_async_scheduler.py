"""AsyncScheduler: step N+1 scheduled before step N's tokens, and who waits for them."""

from tests.core.sim import make_request
from xlm.config import CacheConfig, SchedulerConfig
from xlm.core.async_scheduler import AsyncScheduler
from xlm.core.outputs import ModelRunnerOutput

BS = 4


def make_async(max_len: int = 64) -> AsyncScheduler:
    sc = SchedulerConfig(64, 8, max_len, True, 0, "fcfs")
    return AsyncScheduler(sc, CacheConfig(block_size=BS), 32)


def test_a_sampling_request_is_scheduled_again_before_its_token_arrives():
    sched = make_async()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    first = sched.schedule()
    request = sched.requests["a"]
    assert first.num_scheduled_tokens == {"a": 3}
    assert request.num_output_placeholders == 1
    # Step 2 computes the in-flight token's position while step 1 still runs.
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 4
    outs = sched.update_from_output(first, ModelRunnerOutput(["a"], [[7]]))
    assert [o.new_token_ids for o in outs] == [[7]]
    assert request.num_output_placeholders == 1 and request.output_token_ids == [7]


def test_a_request_needing_its_tokens_on_the_host_waits_for_them():
    sched = make_async()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    sched.requests["a"].host_tokens_only = True  # penalties, bans or a grammar
    first = sched.schedule()
    assert sched.schedule().num_scheduled_tokens == {}
    sched.update_from_output(first, ModelRunnerOutput(["a"], [[7]]))
    assert sched.schedule().num_scheduled_tokens == {"a": 1}


def test_tokens_in_flight_that_end_the_request_are_not_scheduled_past():
    sched = make_async()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    sched.add_request(make_request("b", [4, 5, 6], max_tokens=2))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 3, "b": 3}
    # a's one token is in flight: nothing more to compute; b may still take its second.
    assert sched.schedule().num_scheduled_tokens == {"b": 1}
    outs = sched.update_from_output(first, ModelRunnerOutput(["a", "b"], [[7], [8]]))
    assert {o.request_id: o.finish_reason for o in outs} == {"a": "length", "b": None}
    # The length cap counts the same way: prompt 3 + 1 in flight reaches max_len 4.
    capped = make_async(max_len=4)
    capped.add_request(make_request("c", [1, 2, 3], max_tokens=None))
    capped.schedule()
    assert capped.schedule().num_scheduled_tokens == {}
