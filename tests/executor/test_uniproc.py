"""UniProcExecutor: the engine's executor in one process runs the worker it warmed up,
step by step or dispatched and collected, as transformers generates on the same weights."""

from __future__ import annotations

import pytest

from tests.engine.reference import TINY_ENGINE, hf_greedy, load_hf, tiny_engine
from xlm.config import ModelConfig, ParallelConfig, XlmConfig
from xlm.executor.uniproc import UniProcExecutor
from xlm.sampling_params import SamplingParams


def test_engine_refuses_a_compile_target():
    config = XlmConfig(
        ModelConfig(model="m"), parallel_config=ParallelConfig(target_topology="v5e:2x2")
    )
    with pytest.raises(ValueError, match="only compiles"):
        UniProcExecutor(config)


def test_steps_through_the_executor_generate_as_transformers(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    llm = tiny_engine(path)  # the session's shared TINY_ENGINE
    core = llm.llm_engine.engine_core.engine_core
    executor = core.executor
    assert type(executor) is UniProcExecutor
    assert executor.num_blocks == executor.worker.num_blocks
    assert executor.num_blocks == TINY_ENGINE["num_gpu_blocks_override"]
    compiled = llm.llm_engine.num_compilations
    prompt = list(range(6, 26))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    core.add_request(llm.llm_engine.processor.process_inputs("uniproc-0", prompt, params, None))
    tokens: list[int] = []
    steps = 0
    while core.scheduler.has_unfinished_requests():
        scheduled = core.scheduler.schedule()
        if steps % 2:
            executor.dispatch(scheduled)
            output = executor.collect()
        else:
            output = executor.execute_model(scheduled)
        for out in core.scheduler.update_from_output(scheduled, output):
            tokens.extend(out.new_token_ids)
        steps += 1
    assert tokens == hf_greedy(load_hf(path), prompt, 6).token_ids
    assert llm.llm_engine.num_compilations == compiled, "a program compiled after warm-up"
