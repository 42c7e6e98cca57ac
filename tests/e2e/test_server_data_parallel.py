"""`xlm serve --data-parallel-size 2`: one API server over two engine-core processes.

Both ranks serve concurrent requests (/metrics counts each under its `engine` label); a
repeated prompt prefix goes to the rank that holds it (its prefix-cache hits, none on the
other); killing one rank's process fails its request in flight with a clean 500, /health
answers 503 naming the dead rank, and the other rank keeps answering."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.conftest import write_tiny_checkpoint
from tests.e2e.server_utils import RemoteServer, metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FLAGS = [
    "--data-parallel-size",
    "2",
    "--token-buckets",
    "64,256",
    "--startup-programs",
    "all",
    "--disable-log-stats",
    "--max-model-len",
    "1024",
]
READY = re.compile(r"Engine core process (\d+) ready: .*'data_parallel_rank': (\d+)")
BLOCK = 16  # the default --block-size


def _complete(
    url: str, prompt: list[int], max_tokens: int = 4, timeout: float = 300
) -> httpx.Response:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def _per_engine(url: str, name: str) -> list[float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return [metric_value(text, name, {"engine": str(r)}) or 0.0 for r in range(2)]


def test_two_ranks_route_by_load_and_prefix_and_survive_a_dead_rank(tmp_path):
    rng = np.random.default_rng(0)
    # A context long enough for a request that runs while its rank is killed.
    model = write_tiny_checkpoint("llama", str(tmp_path / "llama"), max_position_embeddings=1024)
    with RemoteServer([*FLAGS, "--served-model-name", "tiny"], model=model) as srv:
        pids = {int(rank): int(pid) for pid, rank in READY.findall(srv.log_tail(400))}
        assert sorted(pids) == [0, 1], srv.log_tail()

        # Load: eight concurrent distinct prompts spread over both ranks.
        prompts = [rng.integers(3, 200, size=40).tolist() for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: _complete(srv.url, p, 16), prompts))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        prompt_tokens = _per_engine(srv.url, "xlm:prompt_tokens_total")
        assert all(t > 0 for t in prompt_tokens) and sum(prompt_tokens) == 8 * 40

        # Affinity: one three-block prefix, then four prompts that share it.
        hits_before = _per_engine(srv.url, "xlm:prefix_cache_hits_total")
        prefix = rng.integers(3, 200, size=3 * BLOCK).tolist()
        for tail in range(5):
            assert _complete(srv.url, [*prefix, 3 + tail]).status_code == 200
        hits = [
            a - b for a, b in zip(_per_engine(srv.url, "xlm:prefix_cache_hits_total"), hits_before)
        ]
        holder = int(np.argmax(hits))
        assert hits[holder] >= 4 * 3 * BLOCK and hits[1 - holder] == 0, hits

        # Kill the holder while it runs a request of the prefix: that request fails cleanly.
        with ThreadPoolExecutor(1) as pool:
            doomed = pool.submit(_complete, srv.url, [*prefix, 100], 900)
            deadline = time.monotonic() + 120
            while _per_engine(srv.url, "xlm:num_requests_running")[holder] < 1:
                assert time.monotonic() < deadline, "the request never ran"
                time.sleep(0.05)
            os.kill(pids[holder], signal.SIGKILL)
            failed = doomed.result(timeout=120)
        assert failed.status_code == 500, failed.text
        assert f"engine {holder} died" in failed.json()["error"]["message"]

        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503
        assert health.json()["error"]["dead_engines"] == [holder]
        # The other rank answers everything now, the prefix's prompts included.
        before = _per_engine(srv.url, "xlm:prompt_tokens_total")[1 - holder]
        for prompt in ([*prefix, 7], prompts[0]):
            answer = _complete(srv.url, prompt)
            assert answer.status_code == 200, answer.text
        after = _per_engine(srv.url, "xlm:prompt_tokens_total")[1 - holder]
        assert after - before == len(prefix) + 1 + len(prompts[0])
        assert srv.proc.poll() is None
