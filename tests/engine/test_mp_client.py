"""ZeroMQ clients and EngineCoreProc, against a stand-in core in a real spawned process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.engine.fake_core import FakeEngineCoreProc, FakeRequest
from xlm.engine.arg_utils import EngineArgs
from xlm.engine.dp_client import make_async_client
from xlm.engine.exceptions import EngineDeadError
from xlm.engine.mp_client import AsyncMPClient, SyncMPClient, _EngineProcess

pytestmark = pytest.mark.timeout(120)


def _collect(client: SyncMPClient, ids: set[str], timeout: float = 30.0) -> dict[str, list]:
    got: dict[str, list] = {i: [] for i in ids}
    finished: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while set(finished) != ids:
        assert time.monotonic() < deadline, "timed out waiting for outputs"
        for out in client.get_output().outputs:
            got[out.request_id].append(out)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    return got


def test_sync_client_round_trip(sync_client: SyncMPClient):
    assert sync_client.ready_info["max_model_len"] == 128
    assert sync_client.ready_info["engine_pid"] != os.getpid()
    sync_client.add_request(FakeRequest("a", [10], max_tokens=3))
    sync_client.add_request(FakeRequest("b", [100, 200], max_tokens=2, logprobs=True))
    got = _collect(sync_client, {"a", "b"})
    assert [o.new_token_ids[0] for o in got["a"]] == [11, 12, 13]
    assert [o.new_token_ids[0] for o in got["b"]] == [201, 202]
    assert got["a"][-1].finish_reason == "length" and got["a"][0].finish_reason is None
    lp = got["b"][0].new_logprobs
    assert isinstance(lp, np.ndarray) and lp.dtype == np.float32 and lp.shape == (1, 3)
    assert sync_client.call_utility("echo", 1, "x") == [1, "x"]
    assert sync_client.reset_prefix_cache() is True
    with pytest.raises(RuntimeError, match="cannot be called"):
        sync_client.call_utility("step")


def test_abort_frees_request_and_idle_stats_follow(sync_client: SyncMPClient):
    sync_client.add_request(FakeRequest("long", [1], max_tokens=10_000))
    first = sync_client.get_output()
    assert first.outputs[0].request_id == "long"
    sync_client.abort_requests(["long"])
    deadline = time.monotonic() + 20
    while True:  # the engine reports zero usage once it goes idle
        out = sync_client.get_output()
        if out.scheduler_stats is not None and out.scheduler_stats.num_running_reqs == 0:
            break
        assert time.monotonic() < deadline
    assert out.scheduler_stats.kv_cache_usage == 0.0


def test_killed_engine_raises_engine_dead_not_hang(sync_client: SyncMPClient):
    os.kill(sync_client.engine.proc.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        sync_client.get_output()
    with pytest.raises(EngineDeadError):
        sync_client.add_request(FakeRequest("late", [1]))
    with pytest.raises(EngineDeadError):
        sync_client.check_health()


def test_shutdown_reaps_engine_process():
    client = SyncMPClient({}, True, FakeEngineCoreProc)
    proc = client.engine.proc
    client.shutdown()
    assert not proc.is_alive() and proc.exitcode == 0
    assert not os.path.exists(client.engine.tmpdir)


def test_async_client_round_trip_and_death():
    async def main() -> None:
        client = AsyncMPClient({"step_sleep": 0.01}, True, FakeEngineCoreProc)
        assert isinstance(client, AsyncMPClient)
        try:
            for i in range(5):
                await client.add_request_async(FakeRequest(f"r{i}", [i * 10], max_tokens=3))
            tokens: dict[str, list[int]] = {}
            finished = set()
            while len(finished) < 5:
                outs = await asyncio.wait_for(client.get_output_async(), 10)
                for out in outs.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finish_reason:
                        finished.add(out.request_id)
            assert tokens == {f"r{i}": [i * 10 + 1, i * 10 + 2, i * 10 + 3] for i in range(5)}
            assert await client.call_utility_async("echo", "y") == ["y"]
            os.kill(client.engine.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                for _ in range(100):  # leftover outputs first, then the error
                    await asyncio.wait_for(client.get_output_async(), 10)
        finally:
            client.shutdown()

    asyncio.run(main())


def test_engine_spawned_early_is_waited_for_by_its_client():
    """`xlm serve` spawns the engine before its imports; the client waits for READY."""
    engine = _EngineProcess({}, True, FakeEngineCoreProc, wait=False)
    assert engine.ready_info == {}  # spawned, not waited for

    async def main() -> None:
        client = make_async_client({}, True, engine=engine)
        try:
            assert client.engine is engine and client.ready_info["max_model_len"] == 128
            await client.add_request_async(FakeRequest("a", [10], max_tokens=2))
            outs = await asyncio.wait_for(client.get_output_async(), 10)
            assert outs.outputs[0].new_token_ids == [11]
        finally:
            client.shutdown()

    asyncio.run(main())
    assert not engine.proc.is_alive() and not os.path.exists(engine.tmpdir)


def test_engine_spawned_early_that_fails_to_start_raises_and_is_reaped():
    engine = _EngineProcess({"fail_start": True}, True, FakeEngineCoreProc, wait=False)
    with pytest.raises(RuntimeError, match="boom at start"):
        make_async_client({}, True, engine=engine)
    assert not engine.proc.is_alive() and not os.path.exists(engine.tmpdir)


def test_engine_spawned_with_refused_engine_args_says_why():
    """`xlm serve` and `xlm generate` spawn the engine with its EngineArgs, before building
    the config themselves: an engine whose config is refused exits quietly, and its
    client's wait for READY raises with the reason."""
    engine = _EngineProcess(
        EngineArgs(model="/nonexistent/model"), True, FakeEngineCoreProc, wait=False
    )
    with pytest.raises(RuntimeError, match="configuration refused.*/nonexistent/model"):
        engine.wait_until_ready()
    assert not engine.proc.is_alive() and not os.path.exists(engine.tmpdir)


def test_an_engine_given_up_before_ready_stops_at_once(capfd, tmp_path):
    """A front end that refuses the config closes the engine it spawned first: stopped
    with SIGTERM, not sent a SHUTDOWN nobody reads yet and then waited for. It leaves
    quietly, even with the signal landing inside its construction (a SystemExit raised
    there was logged as a failed start, with its traceback)."""
    begun = tmp_path / "begun"
    config = {"start_sleep": 60, "started_file": str(begun)}
    engine = _EngineProcess(config, True, FakeEngineCoreProc, wait=False)
    # Into the construction's sleep (a fixed 1 s wait was short for a loaded machine: the
    # signal then came during the spawned process's imports, before its handler).
    deadline = time.monotonic() + 60
    while not begun.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert begun.exists()
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 5
    assert not engine.proc.is_alive() and not os.path.exists(engine.tmpdir)
    assert engine.proc.exitcode == 0
    assert "Traceback" not in capfd.readouterr().err


_EXIT_WITHOUT_SHUTDOWN = """
from tests.engine.fake_core import FakeEngineCoreProc, FakeRequest
from xlm.engine.mp_client import SyncMPClient
client = SyncMPClient({}, True, FakeEngineCoreProc)
client.add_request(FakeRequest("a", [10], max_tokens=1))
while not client.get_output().outputs:
    pass
print(client.engine.proc.pid, flush=True)
"""


def test_sync_client_left_open_at_exit_stops_its_engine_and_exits():
    """A script that never calls shutdown() (`xlm generate`) exits and reaps its engine:
    the client's finalizer stops the engine, wakes and joins the reader, then ends the
    sockets' context (ending it under a reader blocked in recv hung one exit; this test
    does not force that interleaving)."""
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_WITHOUT_SHUTDOWN],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    pid = int(out.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
