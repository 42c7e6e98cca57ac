"""The serving helpers: exceptions mapped to OpenAI errors (a server fault's text stays in
the log), async iterators interleaved and closed, the top-k logprob entries by rank."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from xlm.entrypoints.openai.serving_engine import (
    OpenAIError,
    error_from_exception,
    merge_async_iterators,
    top_entries,
)


def test_client_errors_are_400s_and_server_faults_only_an_id():
    own = OpenAIError("no", param="n")
    assert error_from_exception(own) is own
    bad = error_from_exception(ValueError("temperature=-1 must be >= 0"))
    assert (bad.status, bad.err_type, bad.message) == (400, "invalid_request_error", bad.message)
    assert "temperature=-1" in bad.message
    fault = error_from_exception(RuntimeError("secret /home/someone/path"))
    assert fault.status == 500 and fault.err_type == "server_error"
    assert "/home/someone" not in fault.message and "error id err-" in fault.message


def test_merge_interleaves_every_item_and_closes_the_iterators():
    closed = []

    async def numbers(name, n):
        try:
            for i in range(n):
                await asyncio.sleep(0)
                yield f"{name}{i}"
        finally:
            closed.append(name)

    async def run(stop_after=None):
        got = []
        async for index, item in merge_async_iterators(numbers("a", 3), numbers("b", 2)):
            got.append((index, item))
            if stop_after is not None and len(got) == stop_after:
                break
        return got

    got = asyncio.run(run())
    assert [x for i, x in got if i == 0] == ["a0", "a1", "a2"]
    assert [x for i, x in got if i == 1] == ["b0", "b1"]
    closed.clear()
    assert len(asyncio.run(run(stop_after=1))) == 1
    assert sorted(closed) == ["a", "b"]  # leaving early closes both


def test_top_entries_by_rank():
    entries = {
        5: SimpleNamespace(rank=2),
        7: SimpleNamespace(rank=1),
        9: SimpleNamespace(rank=None),
    }
    assert [t for t, _ in top_entries(entries, sampled=9, k=2)] == [7, 5]
    assert [t for t, _ in top_entries(entries, sampled=9, k=5)] == [7, 5, 9]
