"""A server started cold is healthy once its largest bucket is compiled and answers
requests of every bucket size while the rest compile in the background, with the tokens it
gives once everything is compiled; /metrics counts the programs ready."""

from __future__ import annotations

import time

import httpx

from tests.e2e.server_utils import RemoteServer, metric_value

FLAGS = ["--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "64"]
# First steps of 1 to 64 tokens: every token bucket (1, 2, 4, 8, 16, 24, 32, 48, 64).
LENGTHS = [1, 2, 3, 6, 12, 20, 25, 40, 60]


def _programs(server: RemoteServer) -> tuple[float | None, float | None]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return metric_value(text, "xlm:programs_ready"), metric_value(text, "xlm:programs_total")


def _completions(server: RemoteServer, model: str, prompts: list[list[int]]) -> list[str]:
    """Each prompt's greedy 5-token completion, one request at a time."""
    texts = []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for prompt in prompts:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 5,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
    return texts


def test_cold_server_answers_every_bucket_while_compiling(tiny_checkpoint, tmp_path, monkeypatch):
    """The reference is the same server once every program is ready (each prompt then runs
    in its own bucket, where during compilation it ran padded into a larger ready one)."""
    model = tiny_checkpoint("llama")
    prompts = [[3 + (5 * i + j) % 90 for j in range(n)] for i, n in enumerate(LENGTHS)]
    monkeypatch.setenv("XLM_COMPILATION_CACHE_DIR", str(tmp_path / "cold"))
    with RemoteServer(FLAGS, model=model) as server:
        ready, total = _programs(server)
        deadline = time.monotonic() + 30
        while ready is None and time.monotonic() < deadline:  # the first idle report
            time.sleep(0.2)
            ready, total = _programs(server)
        assert ready is not None and 2 <= ready < total, (ready, total)
        while_compiling = _completions(server, model, prompts)
        deadline = time.monotonic() + 300
        while _programs(server)[0] != total and time.monotonic() < deadline:
            time.sleep(1)
        assert _programs(server) == (total, total)
        assert f"All {int(total)} programs ready" in server.log_tail(200)
        assert _completions(server, model, prompts) == while_compiling
