"""An engine dropped by its user is freed: its runner (programs, weights, KV cache) and
the memory maps of its compiled code. A jitted bound method kept every runner alive, and a
process that made ~60 engines ran out of memory maps (docs/engine.md)."""

from __future__ import annotations

import gc
import weakref

import xlm
from tests.engine.reference import TINY_ENGINE


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_a_dropped_engine_frees_its_runner_and_maps(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    xlm.LLM(model=path, **TINY_ENGINE)  # programs compiled and saved once
    gc.collect()
    before = _maps()
    llm = xlm.LLM(model=path, **TINY_ENGINE)
    llm.generate(["w1 w2 w3"], xlm.SamplingParams(max_tokens=4), use_tqdm=False)
    runner = weakref.ref(llm.llm_engine.engine_core.engine_core.executor.worker.model_runner)
    grown = _maps() - before
    del llm
    gc.collect()
    assert runner() is None, "the runner outlived its engine"
    assert _maps() - before < grown / 2, (before, grown, _maps())
