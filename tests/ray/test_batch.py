"""xlm on Ray Data, on a local Ray cluster (127.0.0.1, 2 CPUs) with 2 replicas of the tiny
model: every record exactly once, greedy text equal to the local LLM.generate, Parquet and
JSONL, and a replica killed by pid mid-job.

What a test costs is mostly its replicas' start-ups (a Ray worker and an engine each), not
its rows: the counts here are enough batches for each replica to hold several at once
(max_concurrent_batches) with more queued behind them."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import xlm  # noqa: E402
from tests.ray.tiny_engine import ENGINE, ENGINE_FLAGS  # noqa: E402
from xlm.ray import ProcessorConfig, build_llm_processor  # noqa: E402
from xlm.ray.replica import FATAL_ROW_ERROR, LLMReplica  # noqa: E402

# 8 batches of 20: both replicas hold 4 at once, and each row kind (text, chat, token ids,
# a row longer than the model) is there.
NUM_RECORDS = 160
BATCH_SIZE = 20
# Replicas take half a CPU each so Ray's read and split tasks still find one.
REPLICA_CPUS = 0.5


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def local_llm(model):
    """The reference: the same model and engine options, in this process, no Ray. A test
    asks for it before its job runs, so its programs (ENGINE's startup_programs="all") are
    in the program cache when the replicas start."""
    return xlm.LLM(model=model, **ENGINE)


def prompt_text(i: int) -> str:
    return " ".join(f"w{(i * 7 + k * 13) % 240}" for k in range(1 + i % 5))


def max_tokens(i: int) -> int:
    return 2 + i % 5


def config(model: str, **kw) -> ProcessorConfig:
    options = dict(engine_kwargs=ENGINE, replicas=2, batch_size=BATCH_SIZE, num_cpus=REPLICA_CPUS)
    return ProcessorConfig(model=model, **{**options, **kw})


def reference_outputs(local_llm, rows: list[dict]) -> list:
    """The local engine's greedy outputs for `rows` (each a `prompt`, `prompt_token_ids` or
    `messages` with its `max_tokens`), in two batched calls rather than one per row:
    greedy tokens do not depend on the batch a request shares."""
    params = [xlm.SamplingParams(max_tokens=r["max_tokens"], temperature=0) for r in rows]
    chats = [i for i, r in enumerate(rows) if "messages" in r]
    others = [i for i, r in enumerate(rows) if "messages" not in r]
    outputs: list = [None] * len(rows)
    if chats:
        convs = [rows[i]["messages"] for i in chats]
        got = local_llm.chat(convs, [params[i] for i in chats], use_tqdm=False)
        for i, out in zip(chats, got):
            outputs[i] = out
    prompts = [
        {"prompt_token_ids": rows[i]["prompt_token_ids"]}
        if "prompt_token_ids" in rows[i]
        else rows[i]["prompt"]
        for i in others
    ]
    for i, out in zip(
        others, local_llm.generate(prompts, [params[i] for i in others], use_tqdm=False)
    ):
        outputs[i] = out
    return outputs


def test_processor_parquet_every_row_exactly_once_equal_to_generate(
    model, local_llm, ray_cluster, tmp_path
):
    # local_llm before ray_cluster: the module's first test compiles the reference's
    # programs before the cluster's daemons start, not while they run beside it.
    rows = []
    for i in range(NUM_RECORDS):
        row = {"idx": i, "sampling_params": {"max_tokens": max_tokens(i)}}
        if i % 50 == 7:
            row["messages"] = [{"role": "user", "content": prompt_text(i)}]
        elif i % 50 == 11:
            row["prompt_token_ids"] = [6 + (i + k) % 200 for k in range(4)]
        else:
            row["prompt"] = prompt_text(i)
        rows.append(row)
    rows[123] = {"idx": 123, "prompt_token_ids": list(range(6, 206))}  # longer than the model
    columns = ["idx", "prompt", "messages", "prompt_token_ids", "sampling_params"]
    table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows])
    pq.write_table(table, tmp_path / "in.parquet")

    processor = build_llm_processor(config(model), sampling_params={"temperature": 0})
    ds = processor(ray.data.read_parquet(str(tmp_path / "in.parquet")))
    ds.write_parquet(str(tmp_path / "out"))
    out = pq.read_table(str(tmp_path / "out")).to_pylist()

    assert sorted(r["idx"] for r in out) == list(range(NUM_RECORDS))  # each exactly once
    by_idx = {r["idx"]: r for r in out}
    assert "too long" in by_idx[123]["error"]
    assert by_idx[123]["generated_text"] is None
    wanted = [i for i in range(NUM_RECORDS) if i != 123]
    refs = reference_outputs(local_llm, [{**rows[i], "max_tokens": max_tokens(i)} for i in wanted])
    for i, ref in zip(wanted, refs):
        got = by_idx[i]
        assert got["error"] is None, got
        assert got["generated_text"] == ref.outputs[0].text, i
        assert got["generated_token_ids"] == list(ref.outputs[0].token_ids), i
        assert got["finish_reason"] == ref.outputs[0].finish_reason
        assert got["num_input_tokens"] == len(ref.prompt_token_ids)
        assert got["num_generated_tokens"] == len(ref.outputs[0].token_ids)
    summary = processor.stats(len(out), 1.0)
    assert summary["output_tokens"] == sum(r["num_generated_tokens"] or 0 for r in out)
    assert sum(r["records"] for r in summary["replicas"]) == NUM_RECORDS


def batch_records(n: int) -> list[dict]:
    records = []
    for i in range(n):
        if i % 100 == 42:
            records.append(
                {
                    "custom_id": f"chat-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "messages": [{"role": "user", "content": prompt_text(i)}],
                        "max_tokens": max_tokens(i),
                        "temperature": 0,
                    },
                }
            )
        elif i % 100 == 77:
            records.append(
                {
                    "custom_id": f"bad-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"prompt": prompt_text(i), "temperature": -1},
                }
            )
        else:
            records.append(
                {
                    "custom_id": f"cmpl-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {
                        "prompt": prompt_text(i),
                        "max_tokens": max_tokens(i),
                        "temperature": 0,
                    },
                }
            )
    return records


def run_batch_args(model: str, infile, outfile, *extra: str, replicas: int = 2):
    from tests.e2e.test_run_batch_jobs import job_files
    from xlm.entrypoints.cli import build_parser

    argv = ["run-batch", "--ray", f"--replicas={replicas}", f"--replica-cpus={REPLICA_CPUS}"]
    argv += ["--ray-batch-size", str(BATCH_SIZE), *job_files(model, infile, outfile)]
    return build_parser().parse_args([*argv, *ENGINE_FLAGS, *extra])


def check_results(results: list[dict], records: list[dict], local_llm) -> None:
    """Input order, each custom_id once, batch ids, and the local engine's greedy text."""
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in records]
    assert len({r["id"] for r in results}) == len(records)
    assert all(r["id"].startswith("batch_req_") for r in results)
    good = [
        (rec, res) for rec, res in zip(records, results) if not rec["custom_id"].startswith("bad")
    ]
    for record, result in zip(records, results):
        if record["custom_id"].startswith("bad"):
            assert result["response"]["status_code"] == 400
            assert result["error"]["message"].startswith("SamplingParams.temperature")
    refs = reference_outputs(local_llm, [rec["body"] for rec, _ in good])
    for (record, result), ref in zip(good, refs):
        assert result["error"] is None, result
        choice = result["response"]["body"]["choices"][0]
        text = choice["message"]["content"] if "messages" in record["body"] else choice["text"]
        assert text == ref.outputs[0].text, record["custom_id"]
        usage = result["response"]["body"]["usage"]
        assert usage["completion_tokens"] == len(ref.outputs[0].token_ids)


@pytest.mark.slow
def test_run_batch_ray_parquet_in_jsonl_out_every_record_once_and_a_rerun_resumes(
    ray_cluster, model, local_llm, tmp_path
):
    """Parquet in (each body a JSON string), JSONL out, 2 replicas: every record once, in
    input order, the local engine's greedy text; a rerun resumes. JSONL in and Parquet out
    are the embeddings test's (one job per format pair would start another replica)."""
    from xlm.ray.batch import run_batch_on_ray

    records = batch_records(NUM_RECORDS)
    infile = tmp_path / "in.parquet"
    pq.write_table(
        pa.Table.from_pylist([{**r, "body": json.dumps(r["body"])} for r in records]), infile
    )
    outfile = tmp_path / "out.jsonl"
    summary = run_batch_on_ray(run_batch_args(model, infile, outfile))

    results = [json.loads(line) for line in outfile.read_text().splitlines()]
    check_results(results, records, local_llm)
    assert summary["records"] == NUM_RECORDS
    assert summary["failed"] == sum(r["custom_id"].startswith("bad") for r in records)
    assert summary["replica_restarts"] == 0 and summary["rows_retried"] == 0

    # A rerun finds every record done and starts no replica.
    again = run_batch_on_ray(run_batch_args(model, infile, outfile))
    assert again["records"] == 0
    assert outfile.read_text().splitlines() == [json.dumps(r) for r in results]


@pytest.mark.slow
def test_replica_killed_mid_job_every_row_exactly_once(ray_cluster, model, local_llm):
    n = 160  # 16 batches of 10: each replica holds 4 when the kill lands, the rest queued
    rows = [{"idx": i, "prompt": prompt_text(i)} for i in range(n)]
    # Long enough rows that the replica still holds the ones it started when the kill
    # lands (with 12 tokens a faster engine finished them between the snapshot and the
    # SIGKILL, and nothing was left to retry).
    params = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    processor = build_llm_processor(config(model, batch_size=10), sampling_params=params)
    ds = processor(ray.data.from_items(rows))
    killed: list[int] = []

    def kill_a_busy_replica() -> None:
        """SIGKILL a replica's process once it has finished rows and holds others."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and processor.job_stats is not None:
            snapshot = ray.get(processor.job_stats.snapshot.remote())
            for replica, s in snapshot.items():
                if s["rows_finished"] >= 20 and s["rows_started"] > s["rows_finished"]:
                    pid = ray.get(processor.job_stats.replica_pids.remote())[replica][-1]
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_a_busy_replica, daemon=True)
    killer.start()
    out = ds.take_all()
    killer.join(timeout=5)

    assert killed, "the job ended before a replica could be killed"
    assert sorted(r["idx"] for r in out) == list(range(n))  # none lost, none twice
    summary = processor.stats(len(out), 1.0)
    assert summary["replica_restarts"] >= 1  # Ray restarted the killed replica...
    assert summary["rows_retried"] >= 1  # ...and ran the rows it held again
    reference = local_llm.generate(
        [r["prompt"] for r in rows], xlm.SamplingParams(**params), use_tqdm=False
    )
    for row in out:
        assert row["error"] is None
        assert row["generated_text"] == reference[row["idx"]].outputs[0].text


class CrashOnRow(LLMReplica):
    """Fault injection: the replica's process dies whenever it runs the row "crash me"."""

    async def _one(self, row):
        if row.get("prompt") == "crash me":
            os._exit(1)
        return await super()._one(row)


@pytest.mark.slow
def test_row_that_kills_its_replica_ends_as_error_record(ray_cluster, model, local_llm):
    rows = [{"idx": i, "prompt": prompt_text(i)} for i in range(40)]
    rows[17]["prompt"] = "crash me"
    params = {"max_tokens": 4, "temperature": 0}
    # One replica (the two-replica paths are the other tests'): it dies with its batch,
    # again alone on the retry, and is restarted each time.
    processor = build_llm_processor(
        config(model, batch_size=10, replicas=1), sampling_params=params, replica_cls=CrashOnRow
    )
    out = processor(ray.data.from_items(rows)).take_all()

    assert sorted(r["idx"] for r in out) == list(range(40))  # the job went on
    by_idx = {r["idx"]: r for r in out}
    assert by_idx[17]["error"] == FATAL_ROW_ERROR
    reference = local_llm.generate(
        [r["prompt"] for r in rows], xlm.SamplingParams(**params), use_tqdm=False
    )
    for i in range(40):
        if i != 17:
            assert by_idx[i]["error"] is None
            assert by_idx[i]["generated_text"] == reference[i].outputs[0].text
    # It died once with its batch, once alone on the retry; then it was answered.
    assert processor.stats(len(out), 1.0)["replica_restarts"] >= 2


@pytest.mark.slow
def test_run_batch_ray_jsonl_in_embeddings_out_as_parquet_lists(ray_cluster, model, tmp_path):
    """JSONL in, Parquet out, one replica (the two-replica merge is the other run-batch
    test's): /v1/embeddings lines of each input kind (one text, two texts, token ids) once
    each, in input order, with LLM.embed's vectors, kept as a list column; a rejected line's
    status and error in their columns."""
    from tests.e2e.test_run_batch_jobs import check_embedding_results, embedding_records
    from xlm.ray.batch import run_batch_on_ray

    # The reference first: its programs are in the program cache when the replica starts.
    llm = xlm.LLM(model=model, runner="pooling", **ENGINE)
    records = embedding_records(30)
    bad = {**records[4], "custom_id": "bad-dimensions"}
    bad["body"] = {**bad["body"], "dimensions": 0}
    records.insert(5, bad)
    infile = tmp_path / "in.jsonl"
    infile.write_text("".join(json.dumps(r) + "\n" for r in records))
    outfile = tmp_path / "out.parquet"
    extra = ("--runner", "pooling", "--served-model-name", "m")
    summary = run_batch_on_ray(run_batch_args(model, infile, outfile, *extra, replicas=1))
    assert summary["records"] == len(records) and summary["failed"] == 1

    rows = pq.read_table(outfile).to_pylist()
    assert [r["custom_id"] for r in rows] == [r["custom_id"] for r in records]
    assert len({r["id"] for r in rows}) == len(records)
    assert all(r["id"].startswith("batch_req_") for r in rows)
    rejected = rows.pop(5)
    assert rejected["status_code"] == 400 and rejected["embedding"] is None
    assert json.loads(rejected["response"])["status_code"] == 400
    assert "dimensions" in json.loads(rejected["error"])["message"]
    records.pop(5)
    assert [r["status_code"] for r in rows] == [200] * len(rows)
    results = [
        {"custom_id": r["custom_id"], "response": json.loads(r["response"]), "error": r["error"]}
        for r in rows
    ]
    check_embedding_results(results, records, llm)
    for row, result in zip(rows, results):
        listed = row["embedding"]
        data = sorted(result["response"]["body"]["data"], key=lambda d: d["index"])
        assert len(listed) == len(data)
        for column, d in zip(listed, data):
            np.testing.assert_allclose(column, d["embedding"], rtol=1e-6)
