"""Request: counts, status and finish reasons, which requests skip the prefix cache."""

from types import SimpleNamespace

import xlm
from tests.core.sim import make_request
from xlm.core.request import Request, RequestStatus


def test_tokens_and_counts_follow_appended_outputs():
    request = make_request("a", [1, 2, 3])
    assert request.status == RequestStatus.WAITING and request.num_cached_tokens == -1
    request.append_output_token_ids(7)
    assert request.num_tokens == 4 and request.num_prompt_tokens == 3
    assert request.num_output_tokens == 1 and request.all_token_ids == [1, 2, 3, 7]
    assert "computed=0" in repr(request)


def test_finished_statuses_and_their_reasons():
    reasons = {
        RequestStatus.WAITING: None,
        RequestStatus.RUNNING: None,
        RequestStatus.PREEMPTED: None,
        RequestStatus.FINISHED_STOPPED: "stop",
        RequestStatus.FINISHED_LENGTH_CAPPED: "length",
        RequestStatus.FINISHED_ABORTED: "abort",
        RequestStatus.FINISHED_ERROR: "error",
    }
    request = make_request("a", [1])
    for status, reason in reasons.items():
        request.status = status
        assert request.is_finished is (reason is not None) is RequestStatus.is_finished(status)
        assert request.get_finished_reason() == reason == RequestStatus.get_finished_reason(status)


def test_prompt_logprobs_and_whole_prompt_pooling_skip_the_prefix_cache():
    assert not make_request("a", [1]).skip_prefix_cache
    wants_prompt = Request("b", [1], xlm.SamplingParams(prompt_logprobs=1), None)
    assert wants_prompt.skip_prefix_cache
    sp = xlm.SamplingParams()
    last = SimpleNamespace(uses_last_token_only=True)
    mean = SimpleNamespace(uses_last_token_only=False)
    assert not Request("c", [1], sp, None, pooling_params=last).skip_prefix_cache
    assert Request("d", [1], sp, None, pooling_params=mean).skip_prefix_cache


def test_penalties_and_bans_need_the_latest_tokens_on_the_host():
    assert not Request("a", [1], xlm.SamplingParams(), None).host_tokens_only
    assert Request("b", [1], xlm.SamplingParams(presence_penalty=0.5), None).host_tokens_only
    assert Request("c", [1], xlm.SamplingParams(min_tokens=2), None).host_tokens_only
