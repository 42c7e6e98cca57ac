"""GET /v1/models: the served names, never the model's path."""

from __future__ import annotations

from tests.entrypoints.openai.test_api_server import make_client


def test_models_do_not_reveal_the_model_path(tokenizer):
    with make_client(tokenizer, "--served-model-name", "smol") as c:
        r = c.get("/v1/models")
        assert r.status_code == 200 and "/home/someone" not in r.text
        assert [m["id"] for m in r.json()["data"]] == ["smol"]
        assert r.json()["data"][0]["root"] == "smol"
        r = c.post("/v1/completions", json={"model": "smol", "prompt": "x", "max_tokens": 2})
        assert r.json()["model"] == "smol"
