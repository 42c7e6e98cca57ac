"""`xlm run-batch` with vLLM's scoring urls (/v1/score, /v1/rerank, /rerank, /classify) on a
tiny Llama cross-encoder: each result's numbers equal transformers' sigmoid of the
classifier logit of the pair encoded as tokenizer(text_1, text_2); rerank results come
most relevant first with top_n applied; a bad body is that line's 400 record."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.conftest import build_tokenizer
from tests.e2e.test_run_batch_jobs import read, run_batch
from tests.models.test_classifier import hf_class_logits, sigmoid, write_tiny_classifier

QUERY = "w1 w2 w3"
DOCS = ["w4 w5", "w6 w7 w8 w9", "w10", "w3 w2 w1 w0 w11"]


def records() -> list[dict]:
    def line(custom_id: str, url: str, body: dict) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    return [
        line("s", "/v1/score", {"model": "m", "text_1": QUERY, "text_2": DOCS}),
        line("r", "/v1/rerank", {"model": "m", "query": QUERY, "documents": DOCS, "top_n": 2}),
        line("r2", "/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS]}),
        line("c", "/classify", {"model": "m", "input": DOCS[:2]}),
        line("bad", "/v1/rerank", {"query": QUERY, "documents": []}),
    ]


@pytest.mark.slow
def test_scoring_lines_equal_transformers(tmp_path):
    model = write_tiny_classifier("llama", str(tmp_path / "model"), num_labels=1)
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    infile.write_text("".join(json.dumps(r) + "\n" for r in records()))
    env = dict(os.environ, XLM_COMPILATION_CACHE_DIR=str(tmp_path / "cc"))
    run_batch(model, str(infile), str(outfile), env, "--served-model-name", "m", rc=1)
    results = {r["custom_id"]: r for r in read(outfile)}
    assert list(results) == [r["custom_id"] for r in records()]
    tokenizer = build_tokenizer()
    want = [
        float(sigmoid(hf_class_logits(model, tokenizer(QUERY, d)["input_ids"]))[0]) for d in DOCS
    ]
    score = results["s"]["response"]["body"]
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-3)
    order = [int(i) for i in np.argsort(want)[::-1]]
    top = results["r"]["response"]["body"]["results"]
    assert [x["index"] for x in top] == order[:2]
    every = results["r2"]["response"]["body"]["results"]
    assert [x["index"] for x in every] == order
    np.testing.assert_allclose([x["relevance_score"] for x in every], sorted(want)[::-1], atol=1e-3)
    classify = results["c"]["response"]["body"]["data"]
    alone = [float(sigmoid(hf_class_logits(model, tokenizer.encode(d)))[0]) for d in DOCS[:2]]
    np.testing.assert_allclose([d["probs"][0] for d in classify], alone, atol=1e-3)
    bad = results["bad"]
    assert bad["response"]["status_code"] == 400 and "documents" in bad["error"]["message"]
