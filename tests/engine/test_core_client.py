"""No leaks, no hangs: failed sends, refused prompts, timed-out calls, undecodable messages."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import msgpack
import pytest

import xlm
from tests.engine.fake_core import FakeEngineCoreProc, FakeRequest
from tests.engine.reference import TINY_ENGINE
from xlm.engine.async_llm import AsyncLLM
from xlm.engine.exceptions import EngineDeadError
from xlm.engine.messages import RequestType
from xlm.engine.mp_client import AsyncMPClient
from xlm.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(240)


def _round_trip(client, request_id: str) -> list[int]:
    client.add_request(FakeRequest(request_id, [10], max_tokens=2))
    tokens: list[int] = []
    deadline = time.monotonic() + 30
    while len(tokens) < 2:
        assert time.monotonic() < deadline, "no outputs"
        for out in client.get_output().outputs:
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
    return tokens


def test_undecodable_messages_are_dropped_and_the_engine_serves_on(sync_client):
    socket = sync_client.engine.input_socket
    bad_class = msgpack.ExtType(3, msgpack.packb(["os:system", {"command": "true"}, 0]))
    for body in (b"\xc1", msgpack.packb(bad_class), msgpack.packb(msgpack.ExtType(99, b""))):
        with sync_client._send_lock:
            socket.send_multipart([RequestType.ADD, body])
    assert _round_trip(sync_client, "after") == [11, 12]
    assert sync_client.engine.is_alive


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


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return xlm.LLM(model=tiny_checkpoint("llama"), **TINY_ENGINE)


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
