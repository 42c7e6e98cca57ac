"""`xlm run-batch`: results in input order, errors per request, resume, sharded replicas."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import openai.types
import openai.types.chat
import pytest

import xlm
from tests.engine_args import cli_flags

# One engine for the whole module: the CLI's flags and an in-process LLM's keywords.
EMBED_ENGINE = dict(
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[8, 64],
    kv_cache_memory=0.02,
)
ENGINE_FLAGS = [*cli_flags(EMBED_ENGINE), "--disable-log-stats"]


def batch_records() -> list[dict]:
    records = []
    for i in range(5):
        records.append(
            {
                "custom_id": f"cmpl-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": f"hello world {i}", "max_tokens": 6, "temperature": 0},
            }
        )
    records.append(
        {
            "custom_id": "chat-0",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 5,
                "temperature": 0,
            },
        }
    )
    records.append(
        {
            "custom_id": "bad-temp",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "hello", "temperature": -1},
        }
    )
    records.append(
        {
            "custom_id": "bad-url",
            "method": "POST",
            "url": "/v1/audio/transcriptions",
            "body": {"input": "hello"},
        }
    )
    return records


@pytest.fixture(scope="module")
def setup(batch_job):
    return batch_job("batch", batch_records())


def job_files(model: str, infile, outfile) -> list[str]:
    """`xlm run-batch`'s input, output and model arguments."""
    return ["-i", str(infile), "-o", str(outfile), "--model", model]


def run_batch(model, infile, outfile, env, *extra, wait=True, rc=0):
    cli = [sys.executable, "-m", "xlm.entrypoints.cli", "run-batch"]
    cmd = [*cli, *job_files(model, infile, outfile), *ENGINE_FLAGS, *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == rc, err[-3000:]
    proc.stderr_text = err
    return proc


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def texts(results: list[dict]) -> list[object]:
    out = []
    for r in results:
        body = r["response"]["body"]
        if r["error"] is not None:
            out.append(("error", r["response"]["status_code"]))
        elif body["object"] == "text_completion":
            out.append(body["choices"][0]["text"])
        else:
            out.append(body["choices"][0]["message"]["content"])
    return out


@pytest.fixture(scope="module")
def full_run(setup):
    """One uninterrupted run of the batch (its process), the reference the other runs meet."""
    model, tmp, infile, env = setup
    outfile = tmp / "out.jsonl"
    proc = run_batch(model, infile, outfile, env, rc=1)  # two records failed: exit 1
    return proc, outfile


def test_results_in_order_with_openai_shapes_and_errors(full_run):
    proc, outfile = full_run
    assert "2 of 8 records failed" in proc.stderr_text
    results = read(outfile)
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in batch_records()]
    for r in results[:5]:
        completion = openai.types.Completion.model_validate(r["response"]["body"])
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert completion.usage.completion_tokens == 6
        assert r["response"]["request_id"] == completion.id
    chat = openai.types.chat.ChatCompletion.model_validate(results[5]["response"]["body"])
    assert chat.choices[0].message.role == "assistant"
    bad_temp, bad_url = results[6], results[7]
    assert bad_temp["response"]["status_code"] == 400
    assert "temperature" in bad_temp["response"]["body"]["error"]["message"]
    assert bad_temp["error"]["message"]
    assert bad_url["response"]["status_code"] == 400
    assert "/v1/audio/transcriptions" in bad_url["response"]["body"]["error"]["message"]


def test_rerun_resumes_after_a_crash(setup, full_run):
    model, tmp, infile, env = setup
    full = read(full_run[1])
    lines = open(full_run[1]).read().splitlines(keepends=True)
    outfile = tmp / "resume.jsonl"
    # A crash after three results, in the middle of writing the fourth.
    open(outfile, "w").write("".join(lines[:3]) + lines[3][:20])
    run_batch(model, infile, outfile, env, rc=1)
    resumed = read(outfile)
    assert [r["id"] for r in resumed[:3]] == [r["id"] for r in full[:3]]  # kept, not redone
    assert [r["custom_id"] for r in resumed] == [r["custom_id"] for r in full]
    assert texts(resumed) == texts(full)  # greedy: the redone ones agree


def test_two_replicas_merge_into_input_order(setup, full_run):
    model, tmp, infile, env = setup
    sharded = tmp / "sharded.jsonl"
    procs = [
        run_batch(
            model, infile, sharded, env, "--num-shards", "2", "--shard-index", str(i), wait=False
        )
        for i in range(2)
    ]
    for proc in procs:  # each replica has one failing record
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 1 and "1 of 4 records failed" in err, err[-3000:]
    merged = read(sharded)
    assert [r["custom_id"] for r in merged] == [r["custom_id"] for r in batch_records()]
    assert texts(merged) == texts(read(full_run[1]))


def test_bad_input_file_is_a_clear_error(setup, tmp_path):
    model, _, _, env = setup
    infile = tmp_path / "broken.jsonl"
    infile.write_text('{"custom_id": "a", "body": {}}\nnot json\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "xlm.entrypoints.cli",
            "run-batch",
            "-i",
            str(infile),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--model",
            model,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "broken.jsonl:2: not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


def embedding_records(n: int) -> list[dict]:
    """n /v1/embeddings lines: one text, two texts, or token ids per line."""
    records = []
    for i in range(n):
        text = " ".join(f"w{(i * 7 + k * 13) % 240}" for k in range(1 + i % 6))
        body_input: object = [text, f"w{i % 200} w{(i + 3) % 200}"] if i % 3 == 1 else text
        if i % 3 == 2:
            body_input = [(i + k) % 250 + 1 for k in range(1 + i % 9)]
        records.append(
            {
                "custom_id": f"e{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "m", "input": body_input},
            }
        )
    return records


def embedding_inputs(record: dict) -> list:
    """A record's inputs as LLM.embed prompts (text, or token ids)."""
    value = record["body"]["input"]
    if isinstance(value, str):
        return [value]
    if all(isinstance(t, int) for t in value):
        return [{"prompt_token_ids": value}]
    return list(value)


def check_embedding_results(results: list[dict], records: list[dict], llm) -> None:
    """Every line once, in input order, with LLM.embed's vectors."""
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in records]
    inputs = [embedding_inputs(record) for record in records]
    # One embed call for every record's inputs (one batch, not one engine pass per line).
    vectors = iter(o.outputs.data for o in llm.embed(sum(inputs, []), use_tqdm=False))
    for record, result, record_inputs in zip(records, results, inputs):
        assert result["error"] is None, result
        body = result["response"]["body"]
        want = [next(vectors) for _ in record_inputs]
        got = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
        assert len(got) == len(want), record["custom_id"]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=record["custom_id"])


@pytest.mark.slow
def test_embedding_lines_equal_llm_embed(batch_job):
    """18 lines: each input shape (one text, two texts, token ids) at each of the six text
    lengths, token ids 3, 6 and 9 long, more sequences than the engine runs at once."""
    model, tmp, infile, env = batch_job("batch-embed", embedding_records(18))
    outfile = tmp / "out.jsonl"
    run_batch(model, infile, outfile, env, "--runner", "pooling", "--served-model-name", "m")
    llm = xlm.LLM(model=model, runner="pooling", **EMBED_ENGINE)
    check_embedding_results(read(outfile), embedding_records(18), llm)
