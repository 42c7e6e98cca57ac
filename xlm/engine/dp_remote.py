"""Data-parallel ranks on other hosts: the front end's side and the `--headless` side.

The API server's host runs `data_parallel_size_local` ranks itself (local processes,
`xlm.engine.mp_client`) and listens at `data_parallel_address:data_parallel_rpc_port`
(`RankRegistry`, a ROUTER socket) for the others. For each remote rank the front end binds
an input (PUSH) and an output (PULL) TCP socket on a free port; a headless host
(`run_headless`) registers each of its ranks there (`{"rank": r}`) and is answered with
that rank's two addresses, then starts the rank's engine process with the same entry
point as a local rank (`EngineCoreProc.run_engine_core`), which connects both sockets and
sends READY. From then on the rank is one more engine of `DPAsyncMPClient` /
`DPSyncMPClient`, speaking the same messages; the front end holds it as a `RemoteEngine`
(the stand-in for a local rank's `_EngineProcess`), which notices the rank's end when
its output connection drops (a killed process closes it; ZeroMQ heartbeats catch a host
that vanished). A headless rank publishes its KV events on tcp at its host's address
(`headless_kv_events`) and registers that endpoint, which the API server's router
subscribes to as it does to a local rank's.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import json
import multiprocessing
import os
import signal
import socket as socket_
import threading
import time
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from xlm import envs
from xlm.config import KVEventsConfig, XlmConfig
from xlm.engine.core_proc import EngineCoreProc
from xlm.engine.messages import RequestType
from xlm.engine.mp_client import push_engine_dead, wait_for_ready
from xlm.engine.serial import MsgpackEncoder
from xlm.logger import init_logger

logger = init_logger(__name__)

# ZeroMQ heartbeats on a remote rank's output connection: a host that vanished without
# closing its TCP connection is declared gone after HEARTBEAT_TIMEOUT_MS.
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 20000


def bind_host(address: str) -> str:
    """The interface to bind for `address`: itself when it is an IP, else all of them (a
    host name, such as a Kubernetes Service's, is what the other hosts connect to)."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return "*"
    return address


def _bind(socket: zmq.Socket, host: str, port: int = 0) -> int:
    """Bind `socket` on tcp://host:port (0: a free port); the port it got."""
    socket.bind(f"tcp://{host}:{port}")
    endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(endpoint.rsplit(":", 1)[1])


class RemoteEngine:
    """A rank on another host as the front end holds it: its two TCP sockets, its READY,
    and whether its connection is up (the same attributes as a local `_EngineProcess`)."""

    def __init__(self, rank: int, address: str) -> None:
        self.rank = rank
        self.ctx = zmq.Context()
        host = bind_host(address)
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.output_socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        in_port = _bind(self.input_socket, host)
        out_port = _bind(self.output_socket, host)
        # What the rank connects to, and what this process connects to (wake_reader).
        self.remote_addresses = {
            "input_address": f"tcp://{address}:{in_port}",
            "output_address": f"tcp://{address}:{out_port}",
        }
        local = "127.0.0.1" if host == "*" else host
        self.output_address = f"tcp://{local}:{out_port}"
        self.registered = threading.Event()
        # Set when another rank failed to start: stop waiting for this one.
        self.cancelled = threading.Event()
        self.peer: str | None = None
        # Where the rank publishes its KV events (tcp on its host), from its registration.
        self.kv_events_endpoint: str | None = None
        self.closing = False
        self.dead_message: str | None = None
        self._connected = False
        self._monitor_socket = self.output_socket.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        self.ready_info: dict[str, Any] = {}
        self._watcher: threading.Thread | None = None

    def wait_until_ready(self, timeout: float) -> None:
        """Wait for the rank's registration, then its READY; then watch its connection."""
        deadline = time.monotonic() + timeout
        while not self.registered.wait(0.2) and time.monotonic() < deadline:
            self._check_cancelled()
        if not self.registered.is_set():
            raise RuntimeError(
                f"data-parallel rank {self.rank} did not register within {timeout:.0f} s: "
                "start it with xlm serve MODEL --headless --data-parallel-start-rank ... on "
                "its host"
            )

        def check_alive() -> None:
            self._check_cancelled()
            if self._poll_monitor(0):
                raise RuntimeError(
                    f"data-parallel rank {self.rank} on {self.peer} disconnected before it "
                    "was ready; see its host's log"
                )

        remaining = max(deadline - time.monotonic(), 1.0)
        self.ready_info = wait_for_ready(self.output_socket, check_alive, remaining)
        self._connected = True
        self._watcher = threading.Thread(
            target=self._watch, daemon=True, name=f"xlm-dp-rank{self.rank}"
        )
        self._watcher.start()

    def _check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise RuntimeError(f"data-parallel rank {self.rank}: start cancelled")

    def _poll_monitor(self, timeout_ms: int) -> bool:
        """Read connection events; True once the rank's connection dropped after READY."""
        try:
            while self._monitor_socket.poll(timeout_ms):
                event = recv_monitor_message(self._monitor_socket)
                if event["event"] == zmq.EVENT_ACCEPTED:
                    self._connected = True
                elif event["event"] == zmq.EVENT_DISCONNECTED and self._connected:
                    return True
                timeout_ms = 0
        except zmq.ZMQError:
            return False
        return False

    def _watch(self) -> None:
        while not self.closing:
            if self._poll_monitor(500):
                if self.closing:
                    return
                message = f"data-parallel rank {self.rank} on {self.peer} disconnected"
                if self.dead_message is None:  # else it said why before it went
                    self.dead_message = message
                logger.error("%s", message)
                push_engine_dead(self.ctx, self.output_address, message)
                return

    @property
    def is_alive(self) -> bool:
        """Whether the rank's connection is up."""
        return self.dead_message is None

    def stop_process(self, timeout: float = 5.0, grace: float = 0.0) -> None:
        """Tell the rank to stop (its host's process exits once all its ranks did)."""
        self.closing = True
        if self._connected and self.dead_message is None:  # else no one would read it
            try:
                self.input_socket.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
                self.input_socket.send_multipart(
                    [RequestType.SHUTDOWN, *MsgpackEncoder().encode(None)]
                )
            except zmq.ZMQError:
                pass

    def wake_reader(self, message: str) -> None:
        """Push ENGINE_DEAD into our own output socket so a blocked reader returns."""
        push_engine_dead(self.ctx, self.output_address, message)

    def close_sockets(self) -> None:
        """Close the sockets (after the watcher, which reads one of them, stopped)."""
        self.closing = True
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)
        self.ctx.destroy(linger=0)

    def close(self) -> None:
        """Stop the rank and close the sockets (also the GC finalizer)."""
        if self.ctx.closed:
            return
        self.stop_process()
        self.close_sockets()


class RankRegistry:
    """The front end's handshake socket: remote ranks register here and get their
    sockets' addresses. Serves until every remote rank registered, or `close`."""

    def __init__(self, address: str, port: int, engines: dict[int, RemoteEngine]) -> None:
        self.engines = engines
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.port = _bind(self.socket, bind_host(address), port)
        self._stop = threading.Event()
        logger.info(
            "Waiting for data-parallel rank(s) %s at tcp://%s:%d",
            sorted(engines),
            address,
            self.port,
        )
        self._thread = threading.Thread(target=self._serve, daemon=True, name="xlm-dp-registry")
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self._stop.is_set() and not all(
            e.registered.is_set() for e in self.engines.values()
        ):
            if not poller.poll(200):
                continue
            identity, payload = self.socket.recv_multipart()
            try:
                hello = json.loads(payload)
                rank, host = hello["rank"], hello.get("host", "?")
            except (ValueError, KeyError, TypeError):
                self.socket.send_multipart([identity, b'{"error": "bad registration"}'])
                continue
            engine = self.engines.get(rank)
            if engine is None or engine.registered.is_set():
                error = f"rank {rank!r} is not a remote rank waiting to register: allowed " + (
                    str(sorted(r for r, e in self.engines.items() if not e.registered.is_set()))
                )
                self.socket.send_multipart([identity, json.dumps({"error": error}).encode()])
                continue
            engine.peer = host
            engine.kv_events_endpoint = hello.get("kv_events_endpoint")
            engine.registered.set()
            self.socket.send_multipart([identity, json.dumps(engine.remote_addresses).encode()])
            logger.info(
                "Data-parallel rank %d registered from %s (KV events at %s)",
                rank,
                host,
                engine.kv_events_endpoint,
            )

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.destroy(linger=1000)


def rank_config(
    xlm_config: XlmConfig, rank: int, kv_events: KVEventsConfig | None = None
) -> XlmConfig:
    """The config of one rank's engine: the same, with its data_parallel_rank and its own
    KV events endpoint (`kv_events`: the events config of all ranks; None: unchanged)."""
    config = copy.copy(xlm_config)
    config.parallel_config = dataclasses.replace(
        xlm_config.parallel_config, data_parallel_rank=rank
    )
    if kv_events is not None:
        config.kv_events_config = kv_events.for_rank(rank)
    return config


def own_address(peer: str, port: int) -> str:
    """This host's address on the route to `peer` (what the peer can connect back to)."""
    with socket_.socket(socket_.AF_INET, socket_.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, port))  # no packet sent: it only picks the route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _free_port_base(host: str, ranks: range) -> int:
    """A port base such that base + r is free on `host` for every rank r in `ranks`."""
    for _ in range(20):
        with socket_.socket() as first:
            first.bind((host, 0))
            base = first.getsockname()[1] - ranks.start
        try:
            for rank in ranks[1:]:
                with socket_.socket() as other:
                    other.bind((host, base + rank))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {len(ranks)} consecutive free ports for KV events on {host}")


def headless_kv_events(config: XlmConfig, ranks: range) -> tuple[KVEventsConfig | None, str]:
    """A headless host's KV events config (`rank_config` gives each rank its endpoint) and
    the host its subscribers connect to. The user's config when it publishes (None when
    it turns events off); by default tcp on this host's address toward the API server, on
    free ports, so that the API server's router can follow these ranks' caches."""
    parallel = config.parallel_config
    host = own_address(
        parallel.data_parallel_address or "127.0.0.1", parallel.data_parallel_rpc_port or 1
    )
    events = config.kv_events_config
    if events is not None:
        return (events if events.publishes else None), host
    base = _free_port_base(host, ranks)
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://{host}:{base}"), host


def events_endpoint(events: KVEventsConfig | None, rank: int, host: str) -> str | None:
    """Where the API server subscribes to `rank`'s events (None: nowhere it can reach)."""
    if events is None:
        return None
    endpoint = events.for_rank(rank).endpoint
    if not endpoint.startswith("tcp://"):
        logger.warning(
            "KV events of rank %d at %s are not reachable from the API server (only tcp is); "
            "its router goes by its own record for this rank",
            rank,
            endpoint,
        )
        return None
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:" + endpoint[len(wildcard) :]
    return endpoint


def register_rank(
    config: XlmConfig, rank: int, timeout: float, kv_events_endpoint: str | None = None
) -> dict[str, str]:
    """Register `rank` with the front end (with where it publishes KV events); its input
    and output addresses."""
    parallel = config.parallel_config
    ctx = zmq.Context()
    try:
        socket = ctx.socket(zmq.DEALER)
        socket.connect(f"tcp://{parallel.data_parallel_address}:{parallel.data_parallel_rpc_port}")
        hello = {
            "rank": rank,
            "host": os.uname().nodename,
            "pid": os.getpid(),
            "kv_events_endpoint": kv_events_endpoint,
        }
        socket.send(json.dumps(hello).encode())
        if not socket.poll(int(timeout * 1000)):
            raise RuntimeError(
                f"no API server answered at {parallel.data_parallel_address}:"
                f"{parallel.data_parallel_rpc_port} within {timeout:.0f} s (rank {rank})"
            )
        reply = json.loads(socket.recv())
    finally:
        ctx.destroy(linger=0)
    if "error" in reply:
        raise RuntimeError(f"the API server refused data-parallel rank {rank}: {reply['error']}")
    return reply


def run_headless(
    config: XlmConfig,
    log_stats: bool = True,
    engine_core_proc_class: type[EngineCoreProc] = EngineCoreProc,
) -> int:
    """`xlm serve --headless`: run this host's ranks for an API server elsewhere, until
    they exit (the server stops them, or SIGTERM here); the exit code is the worst one."""
    from xlm.platforms import current_platform

    parallel = config.parallel_config
    start, local = parallel.data_parallel_start_rank, parallel.data_parallel_local_size
    timeout = envs.XLM_ENGINE_READY_TIMEOUT_S or 600.0
    spawn = multiprocessing.get_context("spawn")
    kv_events, host = headless_kv_events(config, range(start, start + local))
    procs = []
    try:
        for index in range(local):
            rank = start + index
            endpoint = events_endpoint(kv_events, rank, host)
            addresses = register_rank(config, rank, timeout, endpoint)
            proc = spawn.Process(
                target=engine_core_proc_class.run_engine_core,
                name=f"XlmEngineCore-{rank}",
                args=(
                    rank_config(config, rank, kv_events),
                    addresses["input_address"],
                    addresses["output_address"],
                    log_stats,
                    os.getpid(),
                ),
                kwargs={
                    "rank_env": current_platform.data_parallel_env(
                        index, parallel.tensor_parallel_size
                    ),
                    "rank_cpus": current_platform.data_parallel_cpus(index, local),
                },
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            logger.info("Data-parallel rank %d: engine process %d started", rank, proc.pid)
        signal.signal(signal.SIGTERM, lambda *_: _terminate(procs))
        pending = list(procs)
        while pending:
            wait_for_sentinels([p.sentinel for p in pending])
            pending = [p for p in pending if p.is_alive()]
    except BaseException:
        _terminate(procs)
        raise
    for proc in procs:
        proc.join()
    codes = [proc.exitcode or 0 for proc in procs]
    logger.info("Headless ranks %d..%d exited: %s", start, start + local - 1, codes)
    return max(codes, key=abs)


def _terminate(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
