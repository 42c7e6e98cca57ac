"""`xlm serve --data-parallel-size 2`: one API server over two engine-core processes.

Both ranks serve concurrent requests (/metrics counts each under its `engine` label); a
repeated prompt prefix goes to the rank that holds it (its prefix-cache hits, none on the
other); killing one rank's process fails its request in flight with a clean 500, /health
answers 503 naming the dead rank, and the other rank keeps answering. The same with rank 1
on "another host" (a `--headless` process on 127.0.0.1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.conftest import write_tiny_checkpoint
from tests.e2e.server_utils import DEFAULT_ARGS, REPO_ROOT, RemoteServer, metric_value
from tests.ports import free_ports

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


def test_a_rank_on_another_host_serves_and_its_death_leaves_rank_0(tmp_path, tiny_checkpoint):
    import openai

    import xlm

    model = tiny_checkpoint("llama")
    engine = ["--token-buckets", "16,64,256", "--startup-programs", "all", "--max-num-seqs", "8"]
    prompts = [f"w{i} w{i + 3} w{2 * i + 5} w{i + 1}" for i in range(8)]
    reference = xlm.LLM(model=model, max_model_len=256, kv_cache_memory=0.1, max_num_seqs=8)
    params = xlm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference.generate(prompts, params, use_tqdm=False)]
    reference.llm_engine.shutdown()

    rpc_port = free_ports(1)
    hosts = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    hosts += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), XLM_LOGGING_LEVEL="INFO")
    log = open(tmp_path / "headless.log", "w+")
    headless = subprocess.Popen(
        [sys.executable, "-m", "xlm.entrypoints.cli", "serve", model, "--headless"]
        + [*DEFAULT_ARGS, *engine, *hosts, "--data-parallel-start-rank", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(REPO_ROOT),
        start_new_session=True,  # its engine process too, for the clean-up below
    )
    try:
        with RemoteServer([*engine, *hosts, "--disable-log-stats"], model=model) as srv:
            log_tail = srv.log_tail(400)
            assert "Data-parallel rank 1 registered" in log_tail
            # Its KV events on tcp at its host's address, which the router joined.
            assert "(KV events at tcp://127.0.0.1:" in log_tail
            assert "not joined yet" not in log_tail
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)

            def complete(prompt: str) -> str:
                answer = client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=8,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                return answer.choices[0].text

            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(complete, prompts)) == expected
            assert all(t > 0 for t in _per_engine(srv.url, "xlm:prompt_tokens_total"))

            headless.kill()  # the host's process; its engine process follows it
            deadline = time.monotonic() + 120
            while httpx.get(srv.url + "/health", timeout=30).status_code == 200:
                assert time.monotonic() < deadline, "the dead rank was never noticed"
                time.sleep(0.2)
            health = httpx.get(srv.url + "/health", timeout=30)
            assert health.status_code == 503 and health.json()["error"]["dead_engines"] == [1]
            before = _per_engine(srv.url, "xlm:prompt_tokens_total")[0]
            assert [complete(p) for p in prompts[:3]] == expected[:3]
            assert _per_engine(srv.url, "xlm:prompt_tokens_total")[0] > before
            assert srv.proc.poll() is None
    finally:
        if headless.poll() is None:
            headless.kill()
        headless.wait(30)
        try:
            os.killpg(headless.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.seek(0)
        print(log.read()[-4000:])
