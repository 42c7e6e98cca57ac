"""Admission control: sequences in flight stay within max_num_seqs plus the waiting room
(a lone request of any size is admitted), refusals are counted (also for /metrics), a
guarded stream gives its admission back however it ends, and a request's cost is n per
prompt (the server's 429s: tests/e2e/test_server_hardening.py)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from xlm.entrypoints.openai.admission import AdmissionGate, default_max_waiting, request_cost
from xlm.entrypoints.openai.limits import WAITING_PER_SEQ
from xlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


def test_requests_are_admitted_up_to_the_capacity():
    registry = CollectorRegistry()
    gate = AdmissionGate(max_num_seqs=4, max_waiting=2, registry=registry)
    assert gate.capacity == 6
    assert gate.try_acquire(4) and gate.try_acquire(2) and gate.in_flight == 6
    assert not gate.try_acquire(1) and gate.in_flight == 6
    gate.release(2)
    assert not gate.try_acquire(3) and gate.try_acquire(2)
    assert gate.rejected == 2
    assert registry.get_sample_value("xlm:num_requests_rejected_total") == 2.0
    gate.release(100)  # never below zero
    assert gate.in_flight == 0
    assert gate.try_acquire(50) and gate.in_flight == 50  # alone, whatever its size
    assert default_max_waiting(4) == WAITING_PER_SEQ * 4


class _Stream:
    def __init__(self, chunks):
        self.chunks, self.closed = list(chunks), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        chunk = self.chunks.pop(0)
        if isinstance(chunk, Exception):
            raise chunk
        return chunk

    async def aclose(self):
        self.closed = True


@pytest.mark.parametrize("ending", ["exhausted", "error", "client_left"])
def test_a_guarded_stream_releases_its_admission(ending):
    gate = AdmissionGate(max_num_seqs=2, max_waiting=0)
    assert gate.try_acquire(2)
    chunks = ["a", "b", RuntimeError("engine died")] if ending == "error" else ["a", "b", "c"]
    stream = _Stream(chunks)

    async def consume():
        guarded = gate.guard_stream(stream, 2)
        got = []
        try:
            async for chunk in guarded:
                got.append(chunk)
                assert gate.in_flight == 2  # held while the stream runs
                if ending == "client_left" and len(got) == 2:
                    break
        except RuntimeError:
            pass
        await guarded.aclose()
        return got

    got = asyncio.run(consume())
    assert got == (["a", "b"] if ending != "exhausted" else ["a", "b", "c"])
    assert gate.in_flight == 0 and stream.closed


def test_request_cost_is_n_per_prompt():
    messages = [{"role": "user", "content": "hi"}]
    assert request_cost(ChatCompletionRequest(model="m", messages=messages)) == 1
    assert request_cost(ChatCompletionRequest(model="m", messages=messages, n=3)) == 3
    assert request_cost(CompletionRequest(model="m", prompt=["a", "b"], n=2)) == 4
    assert request_cost(CompletionRequest(model="m", prompt=[1, 2, 3], n=2)) == 2  # token ids
    assert request_cost(CompletionRequest(model="m", prompt=[[1], [2], [3]])) == 3
