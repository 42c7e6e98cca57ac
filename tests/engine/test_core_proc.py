"""EngineCoreProc: its message handling and busy loop in this process over the stand-in
core, then its IO threads and failure reports in a real spawned engine process."""

from __future__ import annotations

import queue
import threading
import time

import msgpack
import pytest

from tests.engine.fake_core import FakeEngineCore, FakeEngineCoreProc, FakeRequest
from tests.engine.test_mp_client import _collect
from xlm.engine.core_proc import EngineCoreProc, error_file_path
from xlm.engine.exceptions import EngineDeadError
from xlm.engine.messages import OutputType, RequestType
from xlm.engine.mp_client import SyncMPClient

pytestmark = pytest.mark.timeout(120)


class _WaitingCore(FakeEngineCoreProc):
    """The stand-in with requests whose id starts with "w" still waiting to be scheduled."""

    def is_request_waiting(self, request_id: str) -> bool:
        return request_id.startswith("w")


def _proc(cls: type = FakeEngineCoreProc, **config) -> EngineCoreProc:
    """An EngineCoreProc over the stand-in core, without its sockets and threads."""
    proc = object.__new__(cls)
    FakeEngineCore.__init__(proc, config)
    proc.input_queue = queue.Queue()
    proc.output_queue = queue.Queue()
    proc._waiting_since = {}
    proc._stats_dirty = False
    proc._programs_reported = (0, 0)
    proc._output_address = "tcp://127.0.0.1:1"
    return proc


def _drain(q: queue.Queue) -> list:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def test_error_file_sits_beside_the_ipc_sockets_and_not_over_tcp():
    assert error_file_path("ipc:///tmp/xlm-abc/output") == "/tmp/xlm-abc/engine_error"
    assert error_file_path("tcp://10.0.0.2:5555") is None


def test_send_error_reports_on_the_socket_queue_and_on_disk(tmp_path):
    proc = _proc()
    proc._output_address = f"ipc://{tmp_path}/output"
    proc._send_error("engine core failed: boom")
    assert _drain(proc.output_queue) == [(OutputType.ENGINE_ERROR, "engine core failed: boom")]
    assert (tmp_path / "engine_error").read_text() == "engine core failed: boom"


def test_add_abort_and_a_refused_request_fail_only_that_request():
    proc = _proc()
    assert proc._handle(RequestType.ADD, FakeRequest("a", [1], 4)) is False
    assert proc._handle(RequestType.ADD, FakeRequest("b", [2], 4)) is False
    assert set(proc.requests) == set(proc._waiting_since) == {"a", "b"}
    assert proc._handle(RequestType.ADD, FakeRequest("big", list(range(101)))) is False
    ((kind, refused),) = _drain(proc.output_queue)
    assert kind == OutputType.OUTPUTS and len(refused.outputs) == 1
    out = refused.outputs[0]
    assert (out.request_id, out.new_token_ids, out.finish_reason) == ("big", [], "error")
    assert "never fits" in out.stop_reason and "big" not in proc._waiting_since
    assert proc._handle(RequestType.ABORT, ["a", "unknown"]) is False
    assert set(proc.requests) == set(proc._waiting_since) == {"b"} and proc._stats_dirty
    assert proc._handle(b"?", None) is False and proc.output_queue.empty()
    assert proc._handle(RequestType.SHUTDOWN, None) is True


@pytest.mark.parametrize(
    "method, args, ok, value",
    [
        ("ping", [], True, True),
        ("echo", [1, "x"], True, [1, "x"]),
        ("reset_prefix_cache", [], True, True),
        ("slow_call", ["soon"], False, "TypeError: "),
        ("step", [], False, "ValueError: 'step' cannot be called as a utility"),
        ("add_request", [], False, "ValueError: 'add_request' cannot be called"),
        ("run_busy_loop", [], False, "ValueError: 'run_busy_loop' cannot be called"),
        ("_handle", [], False, "ValueError: '_handle' cannot be called"),
        ("requests", [], False, "ValueError: 'requests' cannot be called"),
        ("no_such_method", [], False, "ValueError: 'no_such_method' cannot be called"),
    ],
)
def test_utility_calls_answer_public_core_methods_only(method, args, ok, value):
    proc = _proc()
    assert proc._handle(RequestType.UTILITY, (7, method, args)) is False
    ((kind, (call_id, got_ok, got)),) = _drain(proc.output_queue)
    assert (kind, call_id, got_ok) == (OutputType.UTILITY_RESULT, 7, ok)
    assert got == value if ok else got.startswith(value), got


def test_queue_times_are_taken_once_when_a_request_is_first_scheduled():
    proc = _proc(_WaitingCore)
    proc._waiting_since = {"a": 10.0, "late": 20.0, "w1": 11.0}
    assert proc._take_queue_times(12.5) == {"a": 2.5, "late": 0.0}
    assert proc._waiting_since == {"w1": 11.0}
    assert proc._take_queue_times(13.0) == {}


def test_busy_loop_steps_while_there_is_work_then_reports_idle_and_stops():
    proc = _proc()
    proc.input_queue.put((RequestType.ADD, FakeRequest("a", [10], max_tokens=3)))
    loop = threading.Thread(target=proc.run_busy_loop, daemon=True)
    loop.start()
    deadline = time.monotonic() + 30
    items: list = []
    while not any(k == OutputType.OUTPUTS and not p.outputs for k, p in items):
        assert time.monotonic() < deadline, items
        items.append(proc.output_queue.get(timeout=30))
    proc.input_queue.put((RequestType.SHUTDOWN, None))
    loop.join(30)
    assert not loop.is_alive()
    kinds = [kind for kind, _ in items]
    assert kinds == [OutputType.QUEUE_TIMES] + [OutputType.OUTPUTS] * 4, kinds
    assert set(items[0][1]) == {"a"} and items[0][1]["a"] >= 0
    steps = [payload.outputs for _, payload in items[1:4]]
    assert [[(o.request_id, o.new_token_ids) for o in step] for step in steps] == [
        [("a", [11])],
        [("a", [12])],
        [("a", [13])],
    ]
    assert steps[-1][0].finish_reason == "length"
    idle = items[-1][1]
    assert idle.outputs == [] and idle.scheduler_stats.num_running_reqs == 0


# ---- in a spawned engine process ------------------------------------------------------


def test_per_request_error_fails_only_that_request(sync_client: SyncMPClient):
    sync_client.add_request(FakeRequest("bad", list(range(101))))
    sync_client.add_request(FakeRequest("good", [1], max_tokens=2))
    got = _collect(sync_client, {"bad", "good"})
    assert got["bad"][0].finish_reason == "error"
    assert "never fits" in got["bad"][0].stop_reason
    assert got["good"][-1].finish_reason == "length"
    sync_client.check_health()


def test_undecodable_messages_are_dropped_and_the_engine_serves_on(sync_client):
    socket = sync_client.engine.input_socket
    bad_class = msgpack.ExtType(3, msgpack.packb(["os:system", {"command": "true"}, 0]))
    for body in (b"\xc1", msgpack.packb(bad_class), msgpack.packb(msgpack.ExtType(99, b""))):
        with sync_client._send_lock:
            socket.send_multipart([RequestType.ADD, body])
    sync_client.add_request(FakeRequest("after", [10], max_tokens=2))
    got = _collect(sync_client, {"after"})
    assert [o.new_token_ids[0] for o in got["after"]] == [11, 12]
    assert sync_client.engine.is_alive


def test_step_failure_is_reported_and_process_exits(sync_client: SyncMPClient):
    sync_client.add_request(FakeRequest("boom", [-1, 2]))
    with pytest.raises(EngineDeadError, match="step failure"):
        sync_client.get_output()
    sync_client.engine.proc.join(10)
    assert sync_client.engine.proc.exitcode == 1


def test_startup_failure_raises_with_cause():
    with pytest.raises(RuntimeError, match="boom at start"):
        SyncMPClient({"fail_start": True}, True, FakeEngineCoreProc)
