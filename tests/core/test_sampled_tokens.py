"""Sampled tokens applied to a request: stop conditions, grammar verdicts, proposals."""

from types import SimpleNamespace

from tests.core.sim import make_request
from xlm.core.request import RequestStatus
from xlm.core.sampled_tokens import (
    append_sampled_tokens,
    append_tokens,
    check_stop,
    roll_back_rejected,
)


class FakeGrammars:
    """A structured output manager whose matcher answers a fixed verdict."""

    def __init__(self, verdict):
        self.verdict = verdict
        self.seen: list[list[int]] = []

    def advance(self, constraint, token_ids):
        self.seen.append(list(token_ids))
        return self.verdict


def constrained(verdict):
    request = make_request("g", [1, 2], max_tokens=10)
    request.structured_output_request = SimpleNamespace(matcher=object())
    return request, FakeGrammars(verdict)


def test_eos_and_stop_tokens_count_only_after_min_tokens():
    request = make_request("a", [1], eos=2, min_tokens=2, stop_token_ids=[5], max_tokens=10)
    assert append_tokens(request, [2], 100) == ([2], False)  # eos before min_tokens
    assert append_tokens(request, [5, 9], 100) == ([5], True)  # the stop token, 2nd output
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == 5
    assert request.output_token_ids == [2, 5] and request.all_token_ids == [1, 2, 5]
    ignoring = make_request("b", [1], eos=2, ignore_eos=True, max_tokens=10)
    assert append_tokens(ignoring, [2, 2], 100) == ([2, 2], False)


def test_max_tokens_and_the_length_cap_end_a_request_as_length():
    request = make_request("a", [1, 2], max_tokens=2)
    assert append_tokens(request, [3, 4, 5], 100) == ([3, 4], True)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    long = make_request("b", [1, 2], max_tokens=None)
    assert not check_stop(long, 1, 4) and long.status == RequestStatus.WAITING
    long.all_token_ids.extend([3, 4])
    assert check_stop(long, 4, 4) and long.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_the_grammar_sees_only_the_kept_tokens_and_may_end_the_request():
    request, grammars = constrained(None)
    assert append_sampled_tokens(request, [3, 4], 100, grammars) == ([3, 4], False)
    assert grammars.seen == [[3, 4]]
    request, grammars = constrained("stop")
    assert append_sampled_tokens(request, [3], 100, grammars) == ([3], True)
    assert request.status == RequestStatus.FINISHED_STOPPED
    request, grammars = constrained("token 3 refused")
    assert append_sampled_tokens(request, [3], 100, grammars) == ([3], True)
    assert request.status == RequestStatus.FINISHED_ERROR
    assert request.stop_reason == "token 3 refused"
    # Stopped by max_tokens first: the grammar is not advanced.
    request, grammars = constrained("stop")
    request.max_tokens = 1
    assert append_sampled_tokens(request, [3, 4], 100, grammars) == ([3], True)
    assert grammars.seen == [] and request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_rejected_proposals_are_taken_back_from_the_computed_tokens():
    request = make_request("a", [1, 2, 3])
    request.num_computed_tokens = 8  # a step computed a sampled token and 4 proposals
    # Two proposals accepted, then the model's own token: 3 tokens out.
    assert roll_back_rejected(request, 4, 3) == 2
    assert request.num_computed_tokens == 6
