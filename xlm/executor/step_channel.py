"""The leader-to-follower channel of a multi-host engine (ZeroMQ over TCP), with heartbeats.

Process 0 binds two ROUTER sockets: `steps` (its main thread sends every call the
followers must mirror, pickled once and sent to each follower) and `heartbeats` (a
thread answers each follower's ping with a pong). A follower connects a DEALER to each.
Either side that hears nothing from the other for the heartbeat timeout logs which
process went silent and ends its own process: a leader blocked in a collective with a
dead follower, or a follower whose leader is gone, would otherwise hang forever.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from typing import Any

import zmq

from xlm.logger import init_logger

logger = init_logger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
_HELLO, _PING, _PONG = b"hello", b"ping", b"pong"


def _fail(message: str) -> None:
    """Log why and end this process now (its main thread may be stuck in a collective)."""
    logger.critical(message)
    for handler in logger.handlers:
        handler.flush()
    os._exit(1)


def _bind_host(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "*"


class LeaderChannel:
    """Process 0's end: waits for every follower, sends each step, watches heartbeats."""

    def __init__(self, host: str, port: int, num_processes: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.ctx = zmq.Context()
        self.steps = self.ctx.socket(zmq.ROUTER)
        # Closing waits (bounded) until the last message, the shutdown, is delivered.
        self.steps.setsockopt(zmq.LINGER, 10_000)
        self.steps.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.steps.bind(f"tcp://{_bind_host(host)}:{port}")
        self._hb_addr = f"tcp://{_bind_host(host)}:{port + 1}"
        self.followers: dict[int, bytes] = {}
        self._last_seen: dict[int, float] = {}
        self._closing = threading.Event()
        self._hb_ready = threading.Event()
        self._hb_bind_error: zmq.ZMQError | None = None
        self._hb_thread = threading.Thread(target=self._heartbeats, name="xlm-heartbeats")
        self._hb_thread.daemon = True
        self._hb_thread.start()
        self._hb_ready.wait()
        if self._hb_bind_error is not None:  # e.g. the port was taken: fail, not hang
            self.steps.close(linger=0)
            raise self._hb_bind_error
        self._wait_for_followers(num_processes - 1)

    def _wait_for_followers(self, count: int) -> None:
        deadline = time.monotonic() + max(300.0, self.timeout_s)
        while len(self.followers) < count:
            if not self.steps.poll(1000):
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, count + 1)) - set(self.followers))
                    raise TimeoutError(f"multihost: follower process(es) {missing} never joined")
                continue
            identity, kind, payload = self.steps.recv_multipart()
            if kind == _HELLO:
                self.followers[int(payload)] = identity
        logger.info("multihost: %d follower process(es) joined.", count)

    def send(self, message: Any) -> None:
        """Send one call to every follower (pickled once)."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for process_id, identity in self.followers.items():
            try:
                self.steps.send_multipart([identity, payload], copy=False)
            except zmq.ZMQError as e:
                _fail(f"multihost: follower process {process_id} is unreachable ({e})")

    def _heartbeats(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self._hb_addr)
        except zmq.ZMQError as e:
            sock.close()
            self._hb_bind_error = e
            self._hb_ready.set()
            return
        self._hb_ready.set()
        while not self._closing.is_set():
            if sock.poll(int(HEARTBEAT_INTERVAL_S * 1000)):
                identity, kind, payload = sock.recv_multipart()
                if kind == _PING:
                    self._last_seen[int(payload)] = time.monotonic()
                    sock.send_multipart([identity, _PONG, b""])
            now = time.monotonic()
            for process_id, seen in list(self._last_seen.items()):
                if now - seen > self.timeout_s and not self._closing.is_set():
                    _fail(
                        f"multihost: follower process {process_id} stopped responding "
                        f"(no heartbeat for {now - seen:.0f} s); the engine cannot continue "
                        "without it, exiting"
                    )
        sock.close()

    def close(self) -> None:
        self._closing.set()
        self._hb_thread.join(timeout=2 * HEARTBEAT_INTERVAL_S)
        self.steps.close()
        self.ctx.term()


class FollowerChannel:
    """A follower's end: joins the leader, receives calls, pings it from a thread."""

    def __init__(self, host: str, port: int, process_id: int, timeout_s: float) -> None:
        self.process_id = process_id
        self.timeout_s = timeout_s
        self.ctx = zmq.Context()
        self.steps = self.ctx.socket(zmq.DEALER)
        self.steps.setsockopt(zmq.LINGER, 0)
        self.steps.connect(f"tcp://{host}:{port}")
        self.steps.send_multipart([_HELLO, str(process_id).encode()])
        self._hb_addr = f"tcp://{host}:{port + 1}"
        self._closing = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeats, name="xlm-heartbeats")
        self._hb_thread.daemon = True
        self._hb_thread.start()

    def recv(self) -> Any:
        """The next call from the leader (blocks; the heartbeat thread guards the wait)."""
        return pickle.loads(self.steps.recv(copy=False).buffer)

    def _heartbeats(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._hb_addr)
        me = str(self.process_id).encode()
        last_pong = time.monotonic()
        while not self._closing.is_set():
            sock.send_multipart([_PING, me])
            deadline = time.monotonic() + HEARTBEAT_INTERVAL_S
            while (wait := deadline - time.monotonic()) > 0:
                if sock.poll(int(wait * 1000)):
                    if sock.recv_multipart()[0] == _PONG:
                        last_pong = time.monotonic()
            silent = time.monotonic() - last_pong
            if silent > self.timeout_s and not self._closing.is_set():
                _fail(
                    f"multihost: leader process 0 stopped responding (no heartbeat for "
                    f"{silent:.0f} s); follower process {self.process_id} exiting"
                )
        sock.close()

    def close(self) -> None:
        self._closing.set()
        self._hb_thread.join(timeout=2 * HEARTBEAT_INTERVAL_S)
        self.steps.close()
        self.ctx.term()
