"""Data-parallel ranks on another host, as local processes on 127.0.0.1: a front end
that runs rank 0 itself and a headless process (`run_headless`) that registers rank 1
over TCP; both ranks serve, and killing the headless rank's process fails its requests
only. Stand-in cores (tests/engine/fake_core.py); `xlm serve` end to end:
tests/e2e/test_server_data_parallel.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import signal
import time

import pytest
import zmq

from tests.engine.fake_core import FakeConfig, FakeEngineCoreProc, FakeRequest
from tests.ports import free_ports
from xlm.config import KVEventsConfig
from xlm.core.kv_events import AllBlocksCleared, BlockStored
from xlm.engine import kv_events_subscriber
from xlm.engine.dp_client import DPAsyncMPClient, DPSyncMPClient
from xlm.engine.dp_remote import (
    RankRegistry,
    RemoteEngine,
    bind_host,
    events_endpoint,
    headless_kv_events,
    rank_config,
    run_headless,
)
from xlm.engine.kv_events_publisher import ZmqEventPublisher

pytestmark = pytest.mark.timeout(180)


def _config(port: int, start_rank: int, **options) -> FakeConfig:
    config = FakeConfig(**options)
    config.parallel_config = dataclasses.replace(
        config.parallel_config,
        data_parallel_size_local=1,
        data_parallel_start_rank=start_rank,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=port,
    )
    return config


def _headless(port: int) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(
        target=run_headless, args=(_config(port, 1, step_sleep=0.01), True, FakeEngineCoreProc)
    )
    proc.start()
    return proc


async def _collect(client, ids: set[str]) -> dict[str, tuple[list[int], str, int]]:
    got: dict[str, list[int]] = {}
    done: dict[str, tuple[list[int], str, int]] = {}
    while set(done) != ids:
        outs = await asyncio.wait_for(client.get_output_async(), 20)
        for out in outs.outputs:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                done[out.request_id] = (got[out.request_id], out.finish_reason, outs.engine_index)
    return done


def _check_remote_kv_events(client) -> None:
    """The router follows the remote rank's KV events at the tcp endpoint it registered
    (the stand-in core publishes none: a publisher of the test's binds it)."""
    endpoint = client.engines[1].engine.kv_events_endpoint
    assert endpoint.startswith("tcp://127.0.0.1:")
    events = KVEventsConfig(True, endpoint=endpoint)
    pub = ZmqEventPublisher(events, data_parallel_rank=1)
    index = client.router.prefix_index
    try:
        deadline = time.monotonic() + 20
        while index.num_blocks(1) == 0:
            assert time.monotonic() < deadline, "the remote rank's events never arrived"
            pub.publish([AllBlocksCleared(), BlockStored([b"h" * 32], None, [], 4)])
            time.sleep(0.05)
    finally:
        pub.shutdown()


def test_a_headless_rank_registers_serves_and_fails_alone(monkeypatch):
    # The stand-in cores publish no events: no use waiting long for the subscriber to join.
    monkeypatch.setattr(kv_events_subscriber, "JOIN_TIMEOUT_MS", 200)
    port = free_ports(1)
    headless = _headless(port)

    async def main() -> None:
        client = DPAsyncMPClient(_config(port, 0, step_sleep=0.01), True, FakeEngineCoreProc)
        try:
            assert isinstance(client.engines[1].engine, RemoteEngine)
            pids = client.ready_info["pids"]
            assert len(set(pids)) == 2 and headless.pid not in pids and os.getpid() not in pids
            for i in range(4):
                await client.add_request_async(FakeRequest(f"r{i}", [i * 10], max_tokens=3))
            done = await _collect(client, {f"r{i}" for i in range(4)})
            assert {r: d[0] for r, d in done.items()} == {
                f"r{i}": [i * 10 + 1, i * 10 + 2, i * 10 + 3] for i in range(4)
            }
            assert sorted(d[2] for d in done.values()) == [0, 0, 1, 1]  # both ranks served
            _check_remote_kv_events(client)
            assert await client.call_utility_async("echo", 7) == [7]
            # Rank 1's engine process dies (its host's process goes with it): its request
            # in flight fails, rank 0 keeps serving.
            await client.add_request_async(FakeRequest("long0", [1], max_tokens=10_000))
            await client.add_request_async(FakeRequest("long1", [2], max_tokens=10_000))
            assert client.router.rank_of("long1") == 1
            os.kill(pids[1], signal.SIGKILL)
            out = await _collect(client, {"long1"})
            assert out["long1"][1] == "error" and out["long1"][2] == 1
            assert client.dead_engines == [1] and not client.engine_dead
            assert "data-parallel rank 1" in client.dead_message
            await client.add_request_async(FakeRequest("after", [50], max_tokens=2))
            assert (await _collect(client, {"after"}))["after"] == ([51, 52], "length", 0)
        finally:
            client.shutdown()

    try:
        asyncio.run(main())
        headless.join(30)
        assert headless.exitcode is not None  # its only rank is gone, so is it
    finally:
        if headless.is_alive():
            headless.kill()


def test_shutdown_stops_the_headless_ranks():
    port = free_ports(1)
    headless = _headless(port)
    try:
        config = _config(port, 0)
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=False)  # no waits
        client = DPSyncMPClient(config, True, FakeEngineCoreProc)
        try:
            for i in range(4):
                client.add_request(FakeRequest(f"r{i}", [i], max_tokens=2))
            ranks = set()
            while len(ranks) < 2:
                ranks.update(client.get_output().engine_index for _ in range(1))
        finally:
            client.shutdown()
        headless.join(30)
        assert headless.exitcode == 0
    finally:
        if headless.is_alive():
            headless.kill()


def test_the_registry_refuses_ranks_it_does_not_wait_for():
    engine = RemoteEngine(1, "127.0.0.1")
    registry = RankRegistry("127.0.0.1", 0, {1: engine})
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{registry.port}")
        sock.send(b'{"rank": 0}')
        assert sock.poll(10_000)
        assert (
            "rank 0 is not a remote rank waiting to register: allowed [1]"
            in (json.loads(sock.recv())["error"])
        )
        sock.send(b'{"rank": 1, "host": "h1"}')
        assert sock.poll(10_000)
        reply = json.loads(sock.recv())
        assert reply == engine.remote_addresses and engine.registered.is_set()
        assert reply["input_address"].startswith("tcp://127.0.0.1:")
    finally:
        ctx.destroy(linger=0)
        registry.close()
        engine.close()
    assert bind_host("10.0.0.2") == "10.0.0.2" and bind_host("xlm-0.xlm") == "*"


def test_a_local_rank_that_fails_to_start_stops_the_wait_for_remote_ones(monkeypatch):
    # Without the cancel, the remote rank (never started here) would be awaited for
    # XLM_ENGINE_READY_TIMEOUT_S (above the test's timeout).
    monkeypatch.setenv("XLM_ENGINE_READY_TIMEOUT_S", "600")
    with pytest.raises(RuntimeError, match="boom at start"):
        DPSyncMPClient(_config(free_ports(1), 0, fail_start=True), True, FakeEngineCoreProc)


def test_headless_ranks_publish_kv_events_where_the_api_server_can_subscribe():
    config = _config(free_ports(1), 2, data_parallel_size=4)
    events, host = headless_kv_events(config, range(2, 4))
    assert host == "127.0.0.1" and events.endpoint.startswith("tcp://127.0.0.1:")
    ranks = [rank_config(config, r, events).kv_events_config.endpoint for r in (2, 3)]
    port = int(ranks[0].rsplit(":", 1)[1])
    assert ranks == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
    assert events_endpoint(events, 3, host) == ranks[1]
    # The host's own config: a wildcard host sent as the host's address, ipc as none.
    config.kv_events_config = KVEventsConfig(True, endpoint="tcp://*:6000")
    given, _ = headless_kv_events(config, range(2, 4))
    assert events_endpoint(given, 3, "10.0.0.3") == "tcp://10.0.0.3:6003"
    assert events_endpoint(KVEventsConfig(True, endpoint="ipc:///tmp/kv"), 3, host) is None
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=False)
    assert headless_kv_events(config, range(2, 4))[0] is None
    assert events_endpoint(None, 3, host) is None
