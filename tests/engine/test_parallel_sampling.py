"""n > 1: a request fans out to n children (ids, seeds, n=1 each) and their outputs merge
per output kind (the same through OutputProcessor: tests/engine/test_output_processor.py)."""

from __future__ import annotations

import pytest

from xlm.engine.messages import EngineCoreRequest
from xlm.engine.parallel_sampling import ParentRequest, fan_out
from xlm.outputs import CompletionOutput
from xlm.sampling_params import RequestOutputKind, SamplingParams


def _out(index: int, text: str, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index, text, [len(text)], None, None, finish_reason=finish)


def test_fan_out_gives_n_children_with_their_own_ids_and_seeds():
    params = SamplingParams(n=3, seed=10, temperature=0.8, max_tokens=5)
    request = EngineCoreRequest("p", [1, 2], params, 2, 4.0, priority=1, prompt="hi")
    children = fan_out(request)
    assert [c.request_id for c, _, _ in children] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c, _, _ in children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 for c, _, _ in children)
    assert [i for _, _, i in children] == [0, 1, 2]
    (parent,) = {id(p): p for _, p, _ in children}.values()
    assert parent.request_id == "p" and parent.n == 3 and parent.metrics.arrival_time == 4.0
    for child, _, _ in children:
        assert (child.prompt_token_ids, child.priority, child.prompt) == ([1, 2], 1, "hi")
        assert child.sampling_params.temperature == 0.8 and child.sampling_params.max_tokens == 5
    assert params.n == 3 and params.seed == 10  # the user's params are not changed


def test_one_completion_is_not_fanned_out_and_unseeded_children_stay_unseeded():
    request = EngineCoreRequest("q", [1], SamplingParams(), None, 0.0)
    assert fan_out(request) == [(request, None, 0)]
    parent = ParentRequest("u", SamplingParams(n=2), 0.0)
    assert [parent.child_params(i).seed for i in range(2)] == [None, None]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_merged_outputs_per_output_kind(kind):
    parent = ParentRequest("p", SamplingParams(n=2, output_kind=kind), 0.0)
    step1 = [_out(1, "b"), _out(0, "a")]
    for c in step1:
        parent.add_output(c)
    first = parent.merged_outputs(step1)
    step2 = [_out(0, "a!", "length")]
    parent.add_output(step2[0])
    assert not parent.finished and parent.unfinished == {1}
    second = parent.merged_outputs(step2)
    step3 = [_out(1, "bc", "stop")]
    parent.add_output(step3[0])
    assert parent.finished
    last = parent.merged_outputs(step3)
    texts = [[c.text for c in outs] for outs in (first, second, last)]
    if kind == RequestOutputKind.DELTA:  # this step's outputs, by index
        assert texts == [["a", "b"], ["a!"], ["bc"]]
    elif kind == RequestOutputKind.CUMULATIVE:  # every child's latest, every step
        assert texts == [["a", "b"], ["a!", "b"], ["a!", "bc"]]
    else:  # FINAL_ONLY: nothing until every child has finished
        assert texts == [[], [], ["a!", "bc"]]
