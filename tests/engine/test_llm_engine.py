"""LLMEngine: a prompt the core refuses leaves nothing behind, request metrics on one clock,
and a refusal from an engine-core process raised as its own class again."""

from __future__ import annotations

import threading
import time

import pytest

from tests.engine.reference import tiny_engine
from xlm.engine.exceptions import EngineBusyError
from xlm.engine.llm_engine import core_refusal
from xlm.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(240)


def test_core_refusal_raises_the_core_error_class_again():
    busy = core_refusal(RuntimeError("EngineBusyError: 2 requests are running"))
    assert type(busy) is EngineBusyError and str(busy) == "2 requests are running"
    bad = core_refusal(RuntimeError("ValueError: level must be 1 or 2, got 3"))
    assert type(bad) is ValueError and str(bad) == "level must be 1 or 2, got 3"
    for text in ("KeyError: 'x'", "engine crashed", "ValueError:no space"):
        error = RuntimeError(text)
        assert core_refusal(error) is error


@pytest.fixture
def llm(tiny_checkpoint):
    """The session's shared TINY_ENGINE LLM (these tests leave it as they found it)."""
    return tiny_engine(tiny_checkpoint("llama"))


def test_request_metrics_use_one_clock_and_first_scheduled_time_is_set(llm):
    greedy = SamplingParams(temperature=0, max_tokens=5)
    for params in (greedy, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5)):
        before = time.time()
        (out,) = llm.generate([[7] * 20], params, use_tqdm=False)
        after = time.time()
        m = out.metrics
        assert m.first_scheduled_time is not None, m
        times = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time]
        assert before <= times[0] and times == sorted(times) and times[-1] <= after, m
        if m.finished_time is not None:
            assert m.last_token_time <= m.finished_time <= after


def test_llm_generate_does_not_hang_after_a_prompt_the_core_refuses(llm):
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=4)
    # The core already holds the id the next generate() will use: its scheduler refuses
    # the request after the output processor has registered it.
    next_id = str(next(llm._request_counter))
    llm._request_counter = iter(range(int(next_id), 1 << 62))
    core_request = engine.processor.process_inputs(next_id, [7] * 10, greedy, None)
    engine.engine_core.add_request(core_request)
    outcome: dict[str, object] = {}

    def refused() -> None:
        try:
            llm.generate([[7] * 20], greedy, use_tqdm=False)
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=refused, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "LLM.generate hung after the core refused the prompt"
    assert isinstance(outcome.get("error"), ValueError) and next_id in str(outcome["error"])
    assert not engine.output_processor.has_unfinished_requests()
    engine.engine_core.abort_requests([next_id])
    (out,) = llm.generate([[7] * 20], greedy, use_tqdm=False)  # the next call works
    assert len(out.outputs[0].token_ids) == 4
