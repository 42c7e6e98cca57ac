"""run-batch's file handling: the input read with line-numbered errors, a torn output cut
and resumed, results in the OpenAI batch format, shards merged in input order (the command
on the real engine: tests/e2e/test_run_batch_*.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from xlm.entrypoints import run_batch
from xlm.entrypoints.run_batch import (
    batch_result,
    count_failed,
    done_ids,
    input_digest,
    is_final,
    merge_shards,
    read_records,
    reorder,
)


def _record(custom_id: str, **extra) -> dict:
    return {"custom_id": custom_id, "url": "/v1/completions", "body": {"prompt": "x"}, **extra}


def _write(path, lines: list) -> str:
    path.write_text("".join(x if isinstance(x, str) else json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_records_are_read_and_a_non_object_line_becomes_its_own_error(tmp_path):
    path = _write(tmp_path / "in.jsonl", [_record("a"), "\n", "[1, 2]\n", _record("b")])
    records = read_records(path)
    assert [r["custom_id"] for r in records] == ["a", "line-3", "b"]
    assert records[1]["input_error"] == "line 3: expected a JSON object, got list"


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json\n", r"in.jsonl:2: not valid JSON"),
        ('{"custom_id": "b", "body": "x"}\n', r"in.jsonl:2: expected an object with a 'body'"),
        ('{"custom_id": "", "body": {}}\n', r"in.jsonl:2: 'custom_id' must be a non-empty"),
        ('{"custom_id": "a", "body": {}}\n', r"in.jsonl:2: duplicate custom_id 'a'"),
    ],
)
def test_a_bad_input_line_fails_the_job_naming_the_line(tmp_path, line, message):
    path = _write(tmp_path / "in.jsonl", [_record("a"), line])
    with pytest.raises(ValueError, match=message):
        read_records(path)


def test_a_torn_output_is_cut_after_its_last_whole_result(tmp_path):
    assert done_ids(str(tmp_path / "none.jsonl")) == set()
    whole = [batch_result("a", 200, {}, "r1"), batch_result("b", 400, {}, None)]
    text = "".join(json.dumps(r) + "\n" for r in whole)
    for torn in ('{"custom_id": "c", "resp', '{"custom_id": "c"}', '"c"\n{"custom_id": "d"}\n'):
        path = tmp_path / "out.jsonl"
        path.write_text(text + torn)
        assert done_ids(str(path)) == {"a", "b"}
        assert path.read_text() == text


def test_results_have_the_openai_batch_shape_and_5xx_is_not_final():
    ok = batch_result("a", 200, {"id": "cmpl-1"}, "cmpl-1")
    assert ok["id"].startswith("batch_req_") and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "cmpl-1", "body": {"id": "cmpl-1"}}
    error = {"error": {"message": "bad n", "type": "BadRequestError", "code": None}}
    bad = batch_result("b", 400, error, None)
    assert bad["error"] == {"code": "BadRequestError", "message": "bad n"}
    assert is_final(ok) and is_final(bad) and not is_final(batch_result("c", 503, error, None))


def test_requests_the_server_cannot_take_are_answered_with_their_error():
    state = object()  # neither record reaches a handler
    bad_line = {"custom_id": "line-2", "input_error": "line 2: expected a JSON object"}
    result = asyncio.run(run_batch.answer(state, bad_line))
    assert result["response"]["status_code"] == 400
    assert result["error"]["message"] == "line 2: expected a JSON object"
    result = asyncio.run(run_batch.answer(state, _record("x", url="/v1/nope")))
    assert result["response"]["status_code"] == 400 and result["custom_id"] == "x"
    assert "unsupported batch endpoint POST '/v1/nope'" in result["error"]["message"]
    for endpoint in run_batch.ENDPOINTS:
        assert endpoint in result["error"]["message"]


def test_reorder_and_merge_write_input_order_and_count_failures(tmp_path):
    results = {c: batch_result(c, 200 if c != "b" else 400, {}, None) for c in "abc"}
    out = _write(tmp_path / "out.jsonl", [results["c"], results["a"], results["b"]])
    reorder(out, ["a", "b", "c"])
    assert [json.loads(x)["custom_id"] for x in open(out)] == ["a", "b", "c"]
    assert count_failed(out, {"a", "b"}) == 1 and count_failed(out, set()) == 0
    shards = [
        _write(tmp_path / "s0", [results["b"]]),
        _write(tmp_path / "s1", [results["c"], results["a"]]),
    ]
    merged = str(tmp_path / "merged.jsonl")
    merge_shards(merged, shards, ["a", "b", "c"])
    assert open(merged).read() == open(out).read()
    with pytest.raises(ValueError, match=r"1 record\(s\) are in no shard file, e.g. custom_id 'd'"):
        merge_shards(merged, shards, ["a", "b", "c", "d"])


def test_a_shard_marker_counts_only_for_the_same_input(tmp_path):
    data = b"".join(json.dumps(_record(str(i))).encode() + b"\n" for i in range(3))
    (tmp_path / "in.jsonl").write_bytes(data)
    digest = input_digest(str(tmp_path / "in.jsonl"))
    assert digest == hashlib.sha256(data).hexdigest()
    shard = str(tmp_path / "out.jsonl.shard-0-of-2")
    assert run_batch._shard_path(str(tmp_path / "out.jsonl"), 0, 2) == shard
    assert not run_batch._marker_ok(shard, digest)
    (tmp_path / "out.jsonl.shard-0-of-2.done").write_text(digest)
    assert run_batch._marker_ok(shard, digest) and not run_batch._marker_ok(shard, "0" * 64)
