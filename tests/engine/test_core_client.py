"""No leaks, no hangs in the engine-core clients: failed sends and timed-out calls (the
engine process's own failures: test_core_proc.py; a refused prompt: test_llm_engine.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from tests.engine.fake_core import FakeEngineCoreProc
from xlm.engine.async_llm import AsyncLLM
from xlm.engine.exceptions import EngineDeadError
from xlm.engine.mp_client import AsyncMPClient
from xlm.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(240)


def test_timed_out_utility_calls_leave_no_pending_future(sync_client):
    with pytest.raises(TimeoutError):
        sync_client.call_utility("slow_call", 1.0, timeout=0.05)
    assert sync_client._pending == {}
    assert sync_client.call_utility("echo", 1) == [1]  # the late answer is ignored
    assert sync_client._pending == {}

    # Callers on many threads at once: every call answered, nothing left behind.
    results: list[object] = []

    def call(i: int) -> None:
        results.append(sync_client.call_utility("echo", i))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r[0] for r in results) == list(range(16))
    assert sync_client._pending == {}


def test_async_timed_out_utility_call_leaves_no_pending_future():
    async def main() -> None:
        client = AsyncMPClient({}, True, FakeEngineCoreProc)
        try:
            with pytest.raises(asyncio.TimeoutError):
                await client.call_utility_async("slow_call", 1.0, timeout=0.05)
            assert client._pending == {}
            assert await client.call_utility_async("echo", 2) == [2]
            assert client._pending == {}
        finally:
            client.shutdown()

    asyncio.run(main())


def test_async_add_request_cleans_up_when_the_send_fails(tokenizer):
    from xlm.engine.processor import Processor

    async def main() -> None:
        client = AsyncMPClient({}, True, FakeEngineCoreProc)
        engine = AsyncLLM(
            None,
            engine_core_client=client,
            tokenizer=tokenizer,
            processor=Processor(tokenizer, max_model_len=128),
        )
        try:
            proc = client.engine.proc
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            params = SamplingParams(n=2, max_tokens=3)
            with pytest.raises(EngineDeadError):
                await engine.add_request("r", {"prompt_token_ids": [5, 6]}, params)
            assert engine.collectors == {} and engine.core_ids == {}
            assert not engine.output_processor.has_unfinished_requests()
            assert engine.num_unfinished_requests == 0
        finally:
            engine.shutdown()

    asyncio.run(main())
