"""EngineLoop (no Ray): rows of a later batch join the running one; rejected rows fail alone."""

from __future__ import annotations

import threading

import pytest

import xlm
from tests.ray.tiny_engine import ENGINE
from xlm.ray.engine_loop import EngineLoop


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return xlm.LLM(model=tiny_checkpoint("llama"), **ENGINE)


def test_next_batch_joins_running_batch_and_matches_generate(llm):
    long_prompts = [f"w{i} w{i + 3} w{i + 7}" for i in range(4)]
    short_prompts = [f"w{i + 50} w{i + 9}" for i in range(4)]
    long_params = xlm.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    short_params = xlm.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    reference = llm.generate(long_prompts, long_params, use_tqdm=False) + llm.generate(
        short_prompts, short_params, use_tqdm=False
    )

    loop = EngineLoop(llm.llm_engine)
    try:
        order: list[str] = []
        lock = threading.Lock()

        def track(name):
            def done(_):
                with lock:
                    order.append(name)

            return done

        futures = []
        for i, p in enumerate(long_prompts):  # batch 1: long generations
            futures.append(loop.submit(p, long_params))
            futures[-1].add_done_callback(track(f"long{i}"))
        for i, p in enumerate(short_prompts):  # batch 2: short ones, submitted after
            futures.append(loop.submit(p, short_params))
            futures[-1].add_done_callback(track(f"short{i}"))
        outputs = [f.result(timeout=120) for f in futures]
    finally:
        loop.shutdown()

    assert [o.outputs[0].token_ids for o in outputs] == [r.outputs[0].token_ids for r in reference]
    # The short rows ran beside the long ones (continuous batching across batches), so all
    # of them finished before the first long row; run batch after batch, none would have.
    first_long = min(order.index(f"long{i}") for i in range(4))
    assert all(order.index(f"short{i}") < first_long for i in range(4)), order


def test_rejected_row_fails_alone(llm):
    loop = EngineLoop(llm.llm_engine)
    try:
        params = xlm.SamplingParams(max_tokens=3, temperature=0)
        bad = loop.submit({"prompt_token_ids": list(range(3, 203))}, params)  # > max_model_len
        good = loop.submit("w1 w2 w3", params)
        with pytest.raises(ValueError, match="too long"):
            bad.result(timeout=60)
        assert len(good.result(timeout=60).outputs[0].token_ids) == 3
        assert loop.dead_error is None
    finally:
        loop.shutdown()
