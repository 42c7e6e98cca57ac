"""`LLM(..., multiprocess=True)`: the offline API over the engine-core process (SyncMPClient)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import API_KEY
from tests.e2e.server_utils import DEFAULT_ARGS, MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _engine_kwargs() -> dict:
    """The shared server's engine flags as LLM keyword arguments (same numerics)."""
    it = iter(DEFAULT_ARGS)
    kwargs = {}
    for flag, value in zip(it, it):
        name = flag[2:].replace("-", "_")
        if name == "token_buckets":
            kwargs[name] = [int(b) for b in value.split(",")]
        elif name != "max_logprobs":
            kwargs[name] = float(value) if "." in value else int(value)
    return kwargs


def test_llm_multiprocess_generates_like_the_server(server):
    import openai

    from xlm.engine.mp_client import SyncMPClient
    from xlm.entrypoints.llm import LLM
    from xlm.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def add(a, b):"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    expected = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    llm = LLM(model=MODEL, multiprocess=True, **_engine_kwargs())
    core = llm.llm_engine.engine_core
    assert isinstance(core, SyncMPClient)
    proc = core.engine.proc
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == expected
        seeded = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6)
        first = llm.generate(prompts[:1], seeded, use_tqdm=False)[0]
        again = llm.generate(prompts[:1], seeded, use_tqdm=False)[0]
        assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
        assert len(first.outputs) == 2
    finally:
        llm.llm_engine.shutdown()
    assert not proc.is_alive() and proc.exitcode == 0


def test_llm_multiprocess_sleep_mode(tiny_checkpoint):
    """Sleep mode through the engine-core process: the same outputs after wake-up, and the
    core's refusals raise as they do in process (ValueError)."""
    from tests.engine.reference import TINY_ENGINE
    from xlm.entrypoints.llm import LLM
    from xlm.sampling_params import SamplingParams

    llm = LLM(
        model=tiny_checkpoint("llama"), multiprocess=True, enable_sleep_mode=True, **TINY_ENGINE
    )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        before = llm.generate([[5, 17, 33]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        compiled = llm.llm_engine.num_compilations
        with pytest.raises(ValueError, match="level=3 is invalid"):
            llm.sleep(3)
        freed = llm.sleep(2)
        assert freed["weights"] > 0 and freed["kv_cache"] > 0
        assert llm.is_sleeping()
        with pytest.raises(ValueError, match="asleep"):
            llm.update_weights(tiny_checkpoint("llama"))
        llm.wake_up()
        assert not llm.is_sleeping()
        after = llm.generate([[5, 17, 33]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert after == before
        assert llm.llm_engine.num_compilations == compiled
    finally:
        llm.llm_engine.shutdown()
