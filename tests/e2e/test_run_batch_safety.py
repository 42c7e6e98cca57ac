"""`xlm run-batch` loses nothing: engine death, 5xx results, stale shard markers, bad options."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.e2e.test_run_batch_jobs import EMBED_ENGINE, read, run_batch, texts
from xlm.entrypoints import run_batch as rb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_RECORDS = 10
MAX_TOKENS = 32  # with 10 records at one at a time: still running when killed


def long_records() -> list[dict]:
    return [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": f"record number {i} says",
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(NUM_RECORDS)
    ]


@pytest.fixture(scope="module")
def setup(batch_job):
    return batch_job("batch-safety", long_records())


def _engine_pid(parent: int) -> int | None:
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
        except OSError:
            continue
    return None


def test_engine_death_stops_the_job_and_a_rerun_completes_it(setup):
    import xlm

    model, tmp, infile, env = setup
    # The uninterrupted job's texts: the same engine in this process (greedy, so a job's
    # batches do not change them), without a third job process to start.
    llm = xlm.LLM(model=model, **EMBED_ENGINE)
    params = xlm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [r["body"]["prompt"] for r in long_records()]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.llm_engine.shutdown()
    del llm

    outfile = tmp / "killed.jsonl"
    # One request at a time, so the job is still running when the first results appear.
    proc = run_batch(model, infile, outfile, env, "--max-concurrency", "1", wait=False)
    deadline = time.monotonic() + 600
    killed = False
    while proc.poll() is None and time.monotonic() < deadline:
        if outfile.exists() and outfile.read_text().count("\n") >= 2:
            pid = _engine_pid(proc.pid)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
        time.sleep(0.02)
    assert killed, "the job finished before the engine could be killed"
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "the engine died" in err and "rerun" in err
    partial = read(outfile)
    assert 2 <= len(partial) < NUM_RECORDS
    assert all(r["error"] is None for r in partial)  # nothing after the death was written

    run_batch(model, infile, outfile, env)
    resumed = read(outfile)
    assert [r["custom_id"] for r in resumed] == [r["custom_id"] for r in long_records()]
    assert texts(resumed) == expected


def test_server_errors_are_not_final_and_exit_nonzero(tmp_path):
    """A 5xx result (engine healthy) is not written; the run says so and exits non-zero."""

    class Engine:
        errored = False
        dead_error = None

    class Handler:
        def __init__(self, fail: set[str]):
            self.fail = fail

        async def create_completion(self, request):
            if request.prompt in self.fail:
                raise RuntimeError("device fell over")
            return SimpleNamespace(
                model_dump=lambda **_: {"id": "cmpl-1", "object": "text_completion"}
            )

    state = SimpleNamespace(engine=Engine(), completion=Handler({"b"}))
    records = [
        {"custom_id": p, "url": "/v1/completions", "body": {"prompt": p}} for p in ("a", "b", "c")
    ]
    out = tmp_path / "out.jsonl"
    failed, redo = asyncio.run(rb.run_records(state, records, str(out), 2))
    assert (failed, redo) == (0, 1)
    assert [r["custom_id"] for r in read(out)] == ["a", "c"]
    # A rerun answers only the missing record, and the file ends in input order.
    state.completion = Handler(set())
    todo = [r for r in records if r["custom_id"] not in rb.done_ids(str(out))]
    assert [r["custom_id"] for r in todo] == ["b"]
    asyncio.run(rb.run_records(state, todo, str(out), 2))
    rb.reorder(str(out), ["a", "b", "c"])
    assert [r["custom_id"] for r in read(out)] == ["a", "b", "c"]


def test_torn_or_non_object_output_lines_are_redone(tmp_path):
    out = tmp_path / "out.jsonl"
    good = json.dumps({"custom_id": "a", "error": None}) + "\n"
    for tail in ("[1, 2]\n", '"text"\n', "42\n", '{"custom_id": 7}\n', '{"custom_id": "b"'):
        out.write_text(good + tail + good.replace('"a"', '"c"'))
        assert rb.done_ids(str(out)) == {"a"}, tail
        assert out.read_text() == good


def test_max_concurrency_zero_is_an_error(setup, tmp_path):
    model, _, infile, env = setup
    proc = run_batch(model, infile, tmp_path / "o.jsonl", env, "--max-concurrency", "0", rc=2)
    assert "--max-concurrency=0 is invalid" in proc.stderr_text


def test_stale_shard_markers_do_not_leak_into_a_new_run(setup, tmp_path):
    model, _, infile, env = setup
    out = tmp_path / "sharded.jsonl"
    # Replica 0's records are already answered (a rerun: no engine to start); an earlier
    # run over other input left shard 1 complete: replica 0 must not merge it.
    mine = long_records()[0::2]
    shard0 = tmp_path / "sharded.jsonl.shard-0-of-2"
    shard0.write_text(
        "".join(json.dumps({"custom_id": r["custom_id"], "error": None}) + "\n" for r in mine)
    )
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(long_records()[1]) + "\n")
    stale = tmp_path / "sharded.jsonl.shard-1-of-2"
    stale.write_text("")
    Path(str(stale) + ".done").write_text(rb.input_digest(str(other)))
    # Replica 1 never runs here: replica 0 waits for a marker of this input, then gives up.
    proc0 = run_batch(
        model,
        infile,
        out,
        env,
        "--num-shards",
        "2",
        "--shard-index",
        "0",
        "--merge-timeout",
        "2",
        wait=False,
    )
    _, err = proc0.communicate(timeout=600)
    assert proc0.returncode != 0 and "shards not complete" in err, err[-3000:]
    assert not out.exists()
    assert [r["custom_id"] for r in read(shard0)] == [r["custom_id"] for r in mine]
    # Its own marker names this input: a replica 1 run over it would complete the merge.
    assert Path(str(shard0) + ".done").read_text() == rb.input_digest(str(infile))


def test_valid_json_input_line_that_is_not_an_object_is_a_per_line_error(tmp_path):
    infile = tmp_path / "in.jsonl"
    good = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}
    infile.write_text(json.dumps(good) + "\n[1, 2]\n" + json.dumps({**good, "custom_id": "c"}))
    records = rb.read_records(str(infile))
    assert [r["custom_id"] for r in records] == ["a", "line-2", "c"]
    result = asyncio.run(rb.answer(SimpleNamespace(), records[1]))
    assert result["custom_id"] == "line-2"
    assert result["response"]["status_code"] == 400
    assert "expected a JSON object, got list" in result["error"]["message"]
    assert rb.is_final(result)  # a request's own 4xx error is final: a rerun does not redo it
