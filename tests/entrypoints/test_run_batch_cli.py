"""`xlm run-batch --merge`: shard files copied from the hosts become one output in input
order, without running a model; a missing shard or record is a clear error."""

from __future__ import annotations

import json

from xlm.entrypoints.cli import main


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_merge_orders_shards_by_input_and_names_what_is_missing(tmp_path, capsys):
    ids = [f"r{i}" for i in range(5)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"prompt": "p", "max_tokens": 1}
    write_jsonl(
        inp,
        [{"custom_id": c, "method": "POST", "url": "/v1/completions", "body": body} for c in ids],
    )
    args = ["run-batch", "-i", str(inp), "-o", str(out), "--num-shards", "2", "--merge"]
    assert main(args) == 2
    assert "shard file(s) not found" in capsys.readouterr().err

    # Replica k took records k, k + 2, ...; replica 1 wrote in its own completion order.
    write_jsonl(tmp_path / "out.jsonl.shard-0-of-2", [{"custom_id": c} for c in ids[0::2]])
    write_jsonl(tmp_path / "out.jsonl.shard-1-of-2", [{"custom_id": "r3"}])
    assert main(args) == 2
    assert "custom_id 'r1'" in capsys.readouterr().err

    write_jsonl(tmp_path / "out.jsonl.shard-1-of-2", [{"custom_id": "r3"}, {"custom_id": "r1"}])
    assert main(args) == 0
    merged = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert merged == ids
