"""Data parallelism offline: `LLM(data_parallel_size=2, tensor_parallel_size=2)` on eight
fake CPU devices generates the same greedy tokens as one engine at TP=2 for 32 prompts,
in input order; both ranks work, each rank's process sees only its own two devices, and
nothing compiles after warm-up. (The server's routing, metrics and a killed rank:
tests/e2e/test_server_data_parallel.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import fake_devices_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ENGINE = dict(
    max_model_len=96,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    token_buckets=[16, 64, 256],
    kv_cache_memory=0.02,
    tensor_parallel_size=2,
)


def _prompts(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    # Token ids past the special ones; lengths from under one block to several blocks.
    return [
        {"prompt_token_ids": rng.integers(3, 200, size=int(rng.integers(4, 60))).tolist()}
        for _ in range(n)
    ]


def test_dp2_tp2_equals_one_engine_for_32_prompts(tiny_checkpoint, monkeypatch):
    from xlm.engine.dp_client import DPSyncMPClient
    from xlm.entrypoints.llm import LLM
    from xlm.sampling_params import SamplingParams

    # Engine processes inherit eight fake devices; a data-parallel rank's process replaces
    # that with its own tensor_parallel_size (xlm.platforms.cpu).
    monkeypatch.setenv("XLA_FLAGS", fake_devices_env(8)["XLA_FLAGS"])
    path = tiny_checkpoint("llama")
    prompts = _prompts(32)  # a full batch (max_num_seqs) on each rank
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    one = LLM(model=path, multiprocess=True, **ENGINE)
    try:
        assert one.llm_engine.engine_core.ready_info["num_local_devices"] == 8
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.llm_engine.shutdown()

    dp = LLM(model=path, data_parallel_size=2, **ENGINE)
    try:
        core = dp.llm_engine.engine_core
        assert isinstance(core, DPSyncMPClient)
        assert [e.ready_info["num_local_devices"] for e in core.engines] == [2, 2]
        outs = dp.generate(prompts, params, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == expected
        per_rank = dp.llm_engine.get_stats_per_engine()
        assert all(s.total_num_scheduled_tokens > 0 for s in per_rank), per_rank
        assert dp.wait_for_programs(timeout=600)
        compiled = dp.llm_engine.num_compilations
        again = dp.generate(prompts[:8], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected[:8]
        assert dp.llm_engine.num_compilations == compiled
    finally:
        dp.llm_engine.shutdown()
    assert not any(e.engine.proc.is_alive() for e in core.engines)


# One DP=2 x TP=1 engine for the router's tests: prefix routing first, then a killed rank.
TP1_ENGINE = dict(
    ENGINE,
    tensor_parallel_size=1,
    max_model_len=128,
    max_num_batched_tokens=128,
    token_buckets=[16, 128],
)


@pytest.fixture(scope="module")
def dp_tp1(tiny_checkpoint):
    """LLM(data_parallel_size=2) at TP=1, shared by the tests below (the last kills rank 1)."""
    from xlm.entrypoints.llm import LLM

    dp = LLM(model=tiny_checkpoint("llama"), data_parallel_size=2, **TP1_ENGINE)
    yield dp
    dp.llm_engine.shutdown()


def test_a_repeated_prefix_goes_to_the_rank_whose_events_show_it(dp_tp1):
    """The router follows both ranks' KV events: a prefix one rank computed draws every
    later prompt with it there (its prefix-cache hits, none on the other rank), with no
    first-block record left to explain it; a prefix-cache reset empties the index."""
    import time

    from xlm.sampling_params import SamplingParams

    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 200, size=64).tolist()  # four full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    dp = dp_tp1
    core = dp.llm_engine.engine_core
    index = core.router.prefix_index
    assert index is not None and core.kv_event_subscriber is not None
    dp.generate([{"prompt_token_ids": [*prefix, 7]}], params, use_tqdm=False)
    deadline = time.monotonic() + 60
    while max(index.num_blocks(0), index.num_blocks(1)) < 4:
        sub = core.kv_event_subscriber
        assert time.monotonic() < deadline, (
            "no BlockStored events from either rank",
            sub.num_batches,
            sub._next_seq,
            sub._thread.is_alive(),
        )
        time.sleep(0.05)
    holder = 0 if index.num_blocks(0) >= 4 else 1
    assert not core.router.prefix_rank  # nothing in flight: no record, only events
    hits_before = [s.prefix_cache_hits for s in dp.llm_engine.get_stats_per_engine()]
    prompts = [{"prompt_token_ids": [*prefix, 8 + i, 9]} for i in range(4)]
    dp.generate(prompts, params, use_tqdm=False)
    hits = [
        s.prefix_cache_hits - b
        for s, b in zip(dp.llm_engine.get_stats_per_engine(), hits_before, strict=True)
    ]
    assert hits[holder] == 4 * 64 and hits[1 - holder] == 0, hits
    assert dp.llm_engine.reset_prefix_cache()
    deadline = time.monotonic() + 60
    while index.num_blocks(holder):
        assert time.monotonic() < deadline, "AllBlocksCleared never reached the index"
        time.sleep(0.05)


def test_a_killed_rank_fails_only_its_own_prompts(dp_tp1, tiny_checkpoint):
    """Offline DP=2, rank 1's process killed mid-run: its prompts in flight finish with
    finish reason "error", every other prompt completes with one engine's greedy tokens;
    the router's own ipc endpoints leave no socket file behind at shutdown."""
    import os
    import signal
    import threading
    import time

    from xlm.entrypoints.llm import LLM
    from xlm.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": p["prompt_token_ids"][:8]} for p in _prompts(12)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    one = LLM(model=tiny_checkpoint("llama"), **TP1_ENGINE)  # in this process
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.llm_engine.shutdown()
    del one

    dp = dp_tp1
    core = dp.llm_engine.engine_core
    socket_file = core.kv_events_config.endpoint[len("ipc://") :]
    assert os.path.exists(socket_file)
    killed: dict[str, int] = {}

    def kill_rank_1() -> None:
        deadline = time.monotonic() + 300
        while core.router.loads[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # its prompts are decoding
        killed["in_flight"] = core.router.loads[1]
        os.kill(core.engines[1].engine.proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1)
    try:
        killer.start()
        outs = dp.generate(prompts, params, use_tqdm=False)
        killer.join()
        failed = [i for i, o in enumerate(outs) if o.outputs[0].finish_reason == "error"]
        assert 0 < len(failed) <= killed["in_flight"], (failed, killed)
        assert all("data-parallel engine 1 died" in outs[i].outputs[0].stop_reason for i in failed)
        done = [i for i in range(len(prompts)) if i not in failed]
        assert len(done) >= len(prompts) // 2
        assert [outs[i].outputs[0].token_ids for i in done] == [expected[i] for i in done]
        assert core.dead_engines == [1]
        # The live rank serves what comes next.
        again = dp.generate(prompts[:2], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected[:2]
    finally:
        killer.join()
        dp.llm_engine.shutdown()
    # The router's own ipc endpoints (the dead rank's too) leave no socket file behind.
    assert not os.path.exists(socket_file), socket_file
    assert not os.path.exists(socket_file + "-dp1"), socket_file + "-dp1"
