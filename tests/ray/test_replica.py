"""A replica's pieces without Ray: rows to prompts and sampling params, batch identity,
the row gate, and a retried batch run row by row (the whole replica on a Ray cluster:
test_batch.py)."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest

from xlm.ray.replica import (
    FATAL_ROW_ERROR,
    LLMReplica,
    RowGate,
    _drop_nulls,
    _fatal_row,
    batch_key,
    run_batch_rows,
)
from xlm.sampling_params import SamplingParams
from xlm.tokenizer import apply_chat_template


def _replica(tokenizer=None, **defaults) -> LLMReplica:
    """An LLMReplica's row handling with no engine: its LLM stands in for the tokenizer."""
    replica = object.__new__(LLMReplica)
    replica.default_sampling_params = defaults
    processor = SimpleNamespace(media_policy=None, mm_processor=None)
    replica.llm = SimpleNamespace(
        llm_engine=SimpleNamespace(processor=processor), get_tokenizer=lambda: tokenizer
    )
    return replica


def test_arrow_nulls_are_dropped_at_every_depth():
    row = {"a": None, "b": [{"c": None, "d": 1}, 2], "e": {"f": None}, "g": 0}
    assert _drop_nulls(row) == {"b": [{"d": 1}, 2], "e": {}, "g": 0}


def test_batch_key_is_a_digest_of_the_rows_with_their_boundaries():
    expected = hashlib.sha1(b"ab\0c\0").hexdigest()
    assert batch_key(["ab", "c"]) == expected
    assert batch_key(["a", "bc"]) != expected and batch_key(["c", "ab"]) != expected


def test_a_row_names_exactly_one_prompt_field(tokenizer):
    replica = _replica(tokenizer)
    assert replica._prompt({"prompt": "hi", "messages": None}) == "hi"
    assert replica._prompt({"prompt_token_ids": [1.0, 2]}) == {"prompt_token_ids": [1, 2]}
    messages = [{"role": "user", "content": "hello there", "name": None}]
    expected = apply_chat_template(tokenizer, [{"role": "user", "content": "hello there"}])
    assert replica._prompt({"messages": messages}) == {"prompt_token_ids": expected}
    for row in ({}, {"prompt": "x", "prompt_token_ids": [1]}):
        with pytest.raises(ValueError, match="exactly one of 'prompt', 'messages'"):
            replica._prompt(row)


def test_row_sampling_params_override_the_defaults_and_n_is_one():
    replica = _replica(max_tokens=8, temperature=0.5)
    params = replica._params({"sampling_params": {"temperature": 0.0, "top_p": None}})
    expected = SamplingParams(max_tokens=8, temperature=0.0)
    assert (params.max_tokens, params.temperature, params.top_p) == (
        expected.max_tokens,
        expected.temperature,
        expected.top_p,
    )
    assert replica._params({}).temperature == 0.5
    with pytest.raises(ValueError, match=r"sampling_params.n=2 is invalid .* allowed 1"):
        replica._params({"sampling_params": {"n": 2}})


def test_an_exclusive_row_waits_for_shared_ones_and_goes_before_new_ones():
    async def main() -> list[str]:
        gate, events = RowGate(), []

        async def shared(name: str, hold: asyncio.Event) -> None:
            async with gate.shared():
                events.append(f"{name} in")
                await hold.wait()
                events.append(f"{name} out")

        async def exclusive() -> None:
            async with gate.exclusive():
                events.append("x in")
                await asyncio.sleep(0)
                events.append("x out")

        release = asyncio.Event()
        first = asyncio.create_task(shared("a", release))
        await asyncio.sleep(0)
        alone = asyncio.create_task(exclusive())
        await asyncio.sleep(0)
        late = asyncio.create_task(shared("b", asyncio.Event()))
        for _ in range(3):
            await asyncio.sleep(0)
        assert events == ["a in"]  # x waits for a; b waits behind x
        release.set()
        await asyncio.gather(first, alone)
        late.cancel()
        for _ in range(3):
            await asyncio.sleep(0)
        return events

    assert asyncio.run(main())[:4] == ["a in", "a out", "x in", "x out"]


class _Ref:
    """What an actor call returns: awaited for its value, or left alone (fire and forget)."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield


class _Stats:
    """The JobStats actor's batch bookkeeping, recording each `stats.method.remote(...)`."""

    def __init__(self, attempt: int, fatal: list[int]) -> None:
        self.calls: list[tuple] = []
        self.answer = (attempt, fatal)

    def __getattr__(self, method: str):
        def remote(*args):
            self.calls.append((method, *args))
            return _Ref(self.answer if method == "begin_batch" else None)

        return SimpleNamespace(remote=remote)


async def _double(row: int) -> int:
    await asyncio.sleep(0)
    return 2 * row


def test_a_first_attempt_runs_all_rows_and_a_retry_skips_the_fatal_one():
    context = SimpleNamespace(stats=None, gate=RowGate())
    rows = [1, 2, 3]
    assert asyncio.run(run_batch_rows(context, "k", rows, _double, _fatal_row)) == [2, 4, 6]
    stats = _Stats(attempt=2, fatal=[1])
    context = SimpleNamespace(stats=stats, gate=RowGate())
    results = asyncio.run(run_batch_rows(context, "k", rows, _double, _fatal_row))
    assert results == [2, {"error": FATAL_ROW_ERROR}, 6]
    assert stats.calls == [
        ("begin_batch", "k"),
        ("row_started", "k", 0),
        ("row_finished", "k"),
        ("row_started", "k", 2),
        ("row_finished", "k"),
        ("end_batch", "k"),
    ]
