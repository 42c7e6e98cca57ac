"""Data-parallel clients: DPAsyncMPClient / DPSyncMPClient over two stand-in cores in real
spawned processes (the router on its own: tests/engine/test_dp_router.py)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.engine.fake_core import FakeConfig, FakeEngineCoreProc
from tests.engine.test_dp_router import _req
from xlm.config import KVEventsConfig
from xlm.core.outputs import SchedulerStats
from xlm.engine import kv_events_subscriber
from xlm.engine.dp_client import (
    DPAsyncMPClient,
    DPSyncMPClient,
    affinity_slack,
    merge_stats,
    rank_config,
    router_kv_events_config,
)
from xlm.engine.exceptions import EngineDeadError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _short_kv_events_join(monkeypatch):
    """The stand-in cores publish no KV events: no use waiting long for their sockets."""
    monkeypatch.setattr(kv_events_subscriber, "JOIN_TIMEOUT_MS", 200)


def test_ranks_get_their_own_kv_events_endpoints_by_default():
    config = FakeConfig()
    events = router_kv_events_config(config)  # none given: the router's own, published
    assert events.publishes and events.endpoint.startswith("ipc://")
    ranks = [rank_config(config, r, events) for r in range(2)]
    assert [c.parallel_config.data_parallel_rank for c in ranks] == [0, 1]
    assert ranks[1].kv_events_config.endpoint == events.endpoint + "-dp1"
    assert config.kv_events_config is None  # the user's config is left alone
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=False)
    assert router_kv_events_config(config) is None  # turned off: first-block affinity
    given = KVEventsConfig(True, endpoint="tcp://*:6000")
    config.kv_events_config = given
    assert router_kv_events_config(config) is given


def test_affinity_slack_and_merged_stats():
    assert affinity_slack(1) == 2 and affinity_slack(256) == 64
    merged = merge_stats(
        [
            SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5, prefix_cache_hits=3),
            SchedulerStats(num_running_reqs=1, kv_cache_usage=0.1, prefix_cache_hits=4),
        ]
    )
    assert merged.num_running_reqs == 3 and merged.prefix_cache_hits == 7
    assert merged.kv_cache_usage == pytest.approx(0.3)


def test_async_dp_client_routes_and_survives_a_dead_rank():
    async def collect(client, ids: set[str]) -> dict[str, tuple[list[int], str, int]]:
        got: dict[str, list[int]] = {}
        done: dict[str, tuple[list[int], str, int]] = {}
        while set(done) != ids:
            outs = await asyncio.wait_for(client.get_output_async(), 10)
            for out in outs.outputs:
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason:
                    done[out.request_id] = (
                        got[out.request_id],
                        out.finish_reason,
                        outs.engine_index,
                    )
        return done

    async def main() -> None:
        client = DPAsyncMPClient(FakeConfig(step_sleep=0.01), True, FakeEngineCoreProc)
        try:
            assert client.ready_info["data_parallel_size"] == 2
            pids = client.ready_info["pids"]
            assert len(set(pids)) == 2 and os.getpid() not in pids
            for i in range(4):
                await client.add_request_async(_req(f"r{i}", [i * 10], max_tokens=3))
            done = await collect(client, {f"r{i}" for i in range(4)})
            assert {r: d[0] for r, d in done.items()} == {
                f"r{i}": [i * 10 + 1, i * 10 + 2, i * 10 + 3] for i in range(4)
            }
            assert sorted(d[2] for d in done.values()) == [0, 0, 1, 1]  # both ranks served
            assert client.router.loads == [0, 0]
            # A long request on each rank; rank 1's process dies mid-way.
            await client.add_request_async(_req("long0", [1], max_tokens=10_000))
            await client.add_request_async(_req("long1", [2], max_tokens=10_000))
            dead = client.router.rank_of("long1")
            os.kill(client.engines[dead].engine.proc.pid, signal.SIGKILL)
            out = await collect(client, {"long1"})
            assert out["long1"][1] == "error" and out["long1"][2] == dead
            assert client.dead_engines == [dead] and not client.engine_dead
            assert f"engine {dead}:" in client.dead_message
            # The live rank takes every new request; the long one there still runs.
            await client.add_request_async(_req("after", [50], max_tokens=2))
            assert client.router.rank_of("after") == 1 - dead
            assert (await collect(client, {"after"}))["after"][:2] == ([51, 52], "length")
            await client.abort_requests_async(["long0"])
            assert await client.call_utility_async("echo", "y") == ["y"]
            os.kill(client.engines[1 - dead].engine.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                for _ in range(100):
                    await asyncio.wait_for(client.get_output_async(), 10)
            assert client.engine_dead
            with pytest.raises(EngineDeadError):
                await client.add_request_async(_req("late", [1]))
        finally:
            client.shutdown()

    asyncio.run(main())


def test_sync_dp_client_merges_both_ranks_outputs():
    client = DPSyncMPClient(FakeConfig(), True, FakeEngineCoreProc)
    try:
        for i in range(6):
            client.add_request(_req(f"r{i}", [i * 10], max_tokens=2))
        done: dict[str, int] = {}
        while len(done) < 6:
            outs = client.get_output()
            for out in outs.outputs:
                if out.finish_reason:
                    done[out.request_id] = outs.engine_index
        assert sorted(done.values()) == [0, 0, 0, 1, 1, 1]
        assert client.router.loads == [0, 0]
        assert client.kv_event_subscriber is not None  # following both ranks' events
        assert client.reset_prefix_cache() is True
        assert [s.num_running_reqs for s in client.get_stats_per_engine()] == [0, 0]
        assert client.call_utility("echo", 1) == [1]
    finally:
        client.shutdown()
    assert not any(e.engine.proc.is_alive() for e in client.engines)


def test_sync_dp_client_fails_only_a_dead_ranks_requests():
    client = DPSyncMPClient(FakeConfig(step_sleep=0.01), True, FakeEngineCoreProc)
    try:
        client.add_request(_req("long0", [1], max_tokens=10_000))
        client.add_request(_req("long1", [2], max_tokens=10_000))
        dead = client.router.rank_of("long1")
        assert client.router.rank_of("long0") == 1 - dead
        client.get_output()  # both run
        os.kill(client.engines[dead].engine.proc.pid, signal.SIGKILL)
        failed = None
        while failed is None:
            for out in client.get_output().outputs:
                if out.finish_reason:
                    failed = out
        assert (failed.request_id, failed.finish_reason) == ("long1", "error")
        assert f"data-parallel engine {dead} died" in failed.stop_reason
        assert client.dead_engines == [dead] and not client.engine_dead
        # The live rank finishes its request and takes every new one.
        client.add_request(_req("after", [50], max_tokens=2))
        assert client.router.rank_of("after") == 1 - dead
        finished: dict[str, list[int]] = {}
        tokens: list[int] = []
        while "after" not in finished:
            for out in client.get_output().outputs:
                if out.request_id == "after":
                    tokens.extend(out.new_token_ids)
                    if out.finish_reason:
                        finished["after"] = tokens
        assert finished["after"] == [51, 52]
        assert client.call_utility("echo", 2) == [2]
        assert [s.num_running_reqs for s in client.get_stats_per_engine()][dead] == 0
        os.kill(client.engines[1 - dead].engine.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            for _ in range(10_000):
                client.get_output()
        assert client.engine_dead
        with pytest.raises(EngineDeadError):
            client.add_request(_req("late", [1]))
    finally:
        client.shutdown()
