"""Run-batch formats and the closing figures of a Ray batch job (no Ray cluster)."""

from __future__ import annotations

import pytest

from xlm.ray.batch import file_format, parse_batch
from xlm.ray.stats import JobStats, summarize


def test_formats_by_flag_then_suffix():
    assert file_format("s3://b/x.parquet", None) == "parquet"
    assert file_format("gs://b/dir.pq/", None) == "parquet"
    assert file_format("in.jsonl", None) == "jsonl"
    assert file_format("in.data", "parquet") == "parquet"


def test_parse_batch_validates_like_the_local_run_batch():
    pa = pytest.importorskip("pyarrow")
    good = '{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}'
    out = parse_batch(pa.table({"text": [good, "  "]}))
    assert out["custom_id"] == ["a"]
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_batch(pa.table({"text": ["{nope"]}))
    with pytest.raises(ValueError, match="'custom_id' must be a non-empty string"):
        parse_batch(pa.table({"text": ['{"body": {}}']}))
    # Parquet rows: body as a JSON string or a struct whose absent fields are nulls.
    rows = pa.Table.from_pylist(
        [
            {"custom_id": "p", "url": "/v1/completions", "body": '{"prompt": "x"}'},
        ]
    )
    assert '"prompt": "x"' in parse_batch(rows)["record"][0]


def test_summary_counts_restarts_and_rows_a_dead_replica_held():
    stats = JobStats()
    stats.replica_started("a", 1, restarted=False)
    stats.replica_started("b", 2, restarted=False)
    stats.batch_started("a", 10)
    stats.batch_finished("a", 10, output_tokens=40)
    stats.batch_started("b", 10)  # b dies holding these 10 rows...
    stats.replica_started("b", 3, restarted=True)
    stats.batch_started("b", 10)  # ...which Ray runs again on its restart
    stats.batch_finished("b", 10, output_tokens=40)
    summary = summarize(stats.snapshot(), rows_out=20, elapsed=2.0)
    assert summary["records_per_s"] == 10.0
    assert summary["output_tok_per_s"] == 40.0
    assert summary["replica_restarts"] == 1
    assert summary["rows_retried"] == 10
    assert [r["records"] for r in summary["replicas"]] == [10, 10]
    assert stats.replica_pids() == {"a": [1], "b": [2, 3]}


def test_fatal_row_is_the_one_a_careful_retry_died_on():
    stats = JobStats()
    assert stats.begin_batch("k") == (1, [])
    assert stats.begin_batch("k") == (2, [])  # retried: rows one by one
    stats.row_started("k", 0)
    stats.row_finished("k")
    stats.row_started("k", 3)  # ...and the replica died here
    assert stats.begin_batch("k") == (3, [3])
    assert stats.num_fatal_rows() == 1
