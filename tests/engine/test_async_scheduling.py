"""Async scheduling (the default) gives what the synchronous loop gives, on SmolLM2.

Step N+1 is scheduled and dispatched while step N runs; its input token for a request
that sampled in step N is read on the device. The synchronous engine
(`async_scheduling=False`) is the reference: greedy and seeded outputs, stop strings,
n > 1, logprobs, penalties and preemption must agree token for token.
"""

from __future__ import annotations

import numpy as np
import pytest

import xlm
from tests.engine.reference import SMOLLM2_ENGINE, num_preemptions
from xlm.core.async_scheduler import AsyncScheduler
from xlm.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):",
    "Water boils at",
    "The three primary colors are",
    "In 1969, the first person to walk on the moon was",
    "A recipe for pancakes needs flour, eggs,",
    "The quick brown fox",
]


def mixed_params() -> list[SamplingParams]:
    """Per prompt: greedy runs of several lengths (EOS on), stop strings, seeded n=2,
    logprobs, penalties, min_tokens and prompt logprobs, repeated to fill a batch."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=48),
        SamplingParams(temperature=0.8, seed=7, max_tokens=40, n=2),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["\n\n", "."], logprobs=3),
        SamplingParams(temperature=0.7, seed=3, max_tokens=36, presence_penalty=0.6),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=20, prompt_logprobs=1, logprobs=1),
        SamplingParams(temperature=1.0, seed=11, top_k=20, max_tokens=44),
        SamplingParams(temperature=0.0, max_tokens=56, ignore_eos=True),
    ]
    return [kinds[(i + i // len(kinds)) % len(kinds)] for i in range(2 * len(kinds))]


def summary(outputs) -> list:
    """What must agree exactly: per completion its tokens, text and finish reason."""
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs
    ]


def sampled_logprobs(outputs) -> list[float]:
    """The logprob of every sampled (and prompt) token that asked for them, flattened."""
    values = []
    for o in outputs:
        for c in o.outputs:
            for lp, t in zip(c.logprobs or (), c.token_ids):
                values.append(lp[t].logprob)
        for lp, t in zip((o.prompt_logprobs or [None])[1:], o.prompt_token_ids[1:]):
            values.append(lp[t].logprob)
    return values


@pytest.fixture(scope="module")
def sync_llm(smollm2_gguf):
    """The reference: the same engine with async scheduling off (loads the saved programs)."""
    return xlm.LLM(model=smollm2_gguf, async_scheduling=False, **SMOLLM2_ENGINE)


def count_overlapped_dispatches(llm) -> list[int]:
    """Counts, in a list, the steps dispatched while the previous one was still in flight."""
    core = llm.llm_engine.engine_core.engine_core
    dispatch = core.executor.dispatch
    counter = [0]

    def counting(scheduler_output):
        counter[0] += bool(core._in_flight) and scheduler_output.total_num_scheduled_tokens > 0
        return dispatch(scheduler_output)

    core.executor.dispatch = counting
    return counter


def test_async_equals_sync_on_a_mixed_preempting_batch(smollm2_llm, sync_llm):
    assert smollm2_llm.llm_engine.engine_core.engine_core.async_scheduling
    assert not sync_llm.llm_engine.engine_core.engine_core.async_scheduling
    # The engine core chose the scheduler class by the flag.
    assert isinstance(smollm2_llm.llm_engine.engine_core.engine_core.scheduler, AsyncScheduler)
    assert not isinstance(sync_llm.llm_engine.engine_core.engine_core.scheduler, AsyncScheduler)
    prompts = PROMPTS * 2
    params = mixed_params()
    overlapped = count_overlapped_dispatches(smollm2_llm)
    results = {}
    for name, llm in (("async", smollm2_llm), ("sync", sync_llm)):
        compiled, preempted = llm.llm_engine.num_compilations, num_preemptions(llm)
        results[name] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.num_compilations == compiled, f"{name}: compiled after warm-up"
        # 20 KV blocks of 16 cannot hold 16 requests of ~60 tokens: requests are preempted
        # and recomputed in both modes (async: also while a token of theirs is in flight).
        assert num_preemptions(llm) > preempted, name
    assert overlapped[0] > 20, "async scheduling never dispatched a step behind another"
    got, want = results["async"], results["sync"]
    assert summary(got) == summary(want)
    # Preemption lands at different steps in the two runs, so batches differ: logprobs
    # agree to float32 batch-order noise.
    np.testing.assert_allclose(sampled_logprobs(got), sampled_logprobs(want), atol=2e-3)
    reasons = {c.finish_reason for o in got for c in o.outputs}
    assert reasons == {"stop", "length"}, reasons
    stop_strings = [c.stop_reason for o in got for c in o.outputs if c.stop_reason in ("\n\n", ".")]
    assert stop_strings, "no request ended on a stop string"


def test_abort_while_a_step_is_in_flight_frees_its_blocks(smollm2_llm, sync_llm):
    """A request aborted between dispatch and collect: its in-flight token is dropped,
    its blocks return to the pool, and the request beside it is unchanged."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    (want,) = sync_llm.generate([PROMPTS[1]], greedy, use_tqdm=False)
    engine = smollm2_llm.llm_engine
    core = engine.engine_core.engine_core
    engine.add_request("keep", PROMPTS[1], greedy)
    engine.add_request("drop", PROMPTS[2], greedy)
    outputs, aborted_in_flight = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        drop = outputs.get("drop")
        if not aborted_in_flight and drop is not None and len(drop.outputs[0].token_ids) >= 5:
            assert core._in_flight, "async scheduling keeps a step in flight while decoding"
            engine.abort_request(["drop"])
            aborted_in_flight = True
    assert aborted_in_flight
    while core.has_unfinished_requests():  # a step may still be in flight: collect it
        core.step()
    assert outputs["keep"].outputs[0].token_ids == want.outputs[0].token_ids
    assert not outputs["drop"].finished or outputs["drop"].outputs[0].finish_reason == "abort"
    assert len(outputs["drop"].outputs[0].token_ids) < 40
    kv = core.scheduler.kv_cache_manager
    assert kv.usage == 0.0 and not core.scheduler.requests and not core._in_flight
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks - 1
