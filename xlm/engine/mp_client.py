"""Engine-core clients over ZeroMQ: the core runs in its own process (EngineCoreProc).

`SyncMPClient` serves `LLMEngine` (blocking calls); `AsyncMPClient` serves `AsyncLLM`
(coroutines). Both bind two ipc sockets in a private temp dir (input PUSH, output PULL),
spawn the engine process, wait for its READY message, and watch the process sentinel:
when the process exits unexpectedly a monitor thread pushes ENGINE_DEAD into the output
socket, so any pending `get_output` raises `EngineDeadError` instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

import zmq
import zmq.asyncio

from xlm import envs
from xlm.config import XlmConfig
from xlm.core.outputs import SchedulerStats
from xlm.engine.arg_utils import EngineArgs
from xlm.engine.core_proc import EngineCoreProc, error_file_path
from xlm.engine.exceptions import EngineDeadError
from xlm.engine.messages import EngineCoreOutputs, EngineCoreRequest, OutputType, RequestType
from xlm.engine.serial import MsgpackDecoder, MsgpackEncoder
from xlm.logger import init_logger

logger = init_logger(__name__)

# Seconds between noticing the engine process exit and declaring it dead without a cause.
_DEATH_GRACE_S = 0.5


def wait_for_ready(
    output_socket: zmq.Socket, check_alive: Callable[[], None], timeout: float | None = None
) -> dict[str, Any]:
    """Wait for an engine's READY message on its output socket and return its payload;
    `check_alive` raises while nothing arrives once the engine is known to be gone."""
    timeout = timeout or envs.XLM_ENGINE_READY_TIMEOUT_S or 600.0
    deadline = time.monotonic() + timeout
    decoder = MsgpackDecoder()
    poller = zmq.Poller()
    poller.register(output_socket, zmq.POLLIN)
    while time.monotonic() < deadline:
        if poller.poll(100):
            frames = output_socket.recv_multipart(copy=False)
            kind, payload = frames[0].bytes, decoder.decode(frames[1:])
            if kind == OutputType.READY:
                logger.info("Engine core process %s ready: %s", payload.get("pid"), payload)
                return payload
            if kind == OutputType.ENGINE_ERROR:
                raise RuntimeError(f"engine core failed to start: {payload}")
            logger.warning("Unexpected message %r before READY", kind)
        else:
            check_alive()
    raise RuntimeError(f"engine core was not ready within {timeout:.0f} s")


def push_engine_dead(ctx: zmq.Context, output_address: str, message: str) -> None:
    """Push ENGINE_DEAD into a client's own output socket so a blocked reader returns."""
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(output_address)
        sock.send_multipart([OutputType.ENGINE_DEAD, *MsgpackEncoder().encode(message)])
        sock.close(linger=1000)
    except zmq.ZMQError:
        pass


class _EngineProcess:
    """The spawned engine process, its sockets' addresses, and its monitor.

    `wait=False` returns once the process is spawned (`start_engine_process`): the caller
    does other start-up work while the engine loads, then calls `wait_until_ready`."""

    def __init__(
        self,
        xlm_config: XlmConfig | EngineArgs,
        log_stats: bool,
        engine_core_proc_class: type[EngineCoreProc],
        rank_env: dict[str, str] | None = None,
        rank_cpus: set[int] | None = None,
        wait: bool = True,
    ) -> None:
        base = envs.XLM_RPC_BASE_PATH
        os.makedirs(base, exist_ok=True)
        self.tmpdir = tempfile.mkdtemp(prefix="xlm-engine-", dir=base)
        self.input_address = f"ipc://{self.tmpdir}/input.sock"
        self.output_address = f"ipc://{self.tmpdir}/output.sock"
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.bind(self.input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(self.output_address)
        self.closing = False
        self.dead_message: str | None = None
        spawn = multiprocessing.get_context("spawn")
        self.proc = spawn.Process(
            target=engine_core_proc_class.run_engine_core,
            name="XlmEngineCore",
            args=(xlm_config, self.input_address, self.output_address, log_stats, os.getpid()),
            kwargs={"rank_env": rank_env, "rank_cpus": rank_cpus},
            daemon=True,
        )
        self.proc.start()
        self.ready_info: dict[str, Any] = {}
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> dict[str, Any]:
        """Wait for the engine's READY (once), then watch the process; a failure to start
        stops the process and raises."""
        if self.ready_info:
            return self.ready_info
        try:
            self.ready_info = self._wait_for_ready()
        except BaseException:
            self.close()
            raise
        self._monitor = threading.Thread(target=self._monitor_process, daemon=True)
        self._monitor.start()
        return self.ready_info

    def _wait_for_ready(self) -> dict[str, Any]:
        def check_alive() -> None:
            if not self.proc.is_alive():
                reason = "see its log above"
                try:  # a config it refused (spawned with EngineArgs) is only there
                    with open(error_file_path(self.output_address) or "") as f:
                        reason = f.read()
                except OSError:
                    pass
                raise RuntimeError(
                    f"engine core process exited with code {self.proc.exitcode} before it "
                    f"was ready: {reason}"
                )

        return wait_for_ready(self.output_socket, check_alive)

    def _monitor_process(self) -> None:
        wait_for_sentinels([self.proc.sentinel])
        if self.closing:
            return
        # An engine that failed sent ENGINE_ERROR (the real cause) just before exiting: let
        # the reader take it first; this generic message is only for silent deaths.
        time.sleep(_DEATH_GRACE_S)
        message = f"the engine core process exited (code {self.proc.exitcode})"
        try:
            with open(error_file_path(self.output_address)) as f:
                message = f.read()
        except OSError:
            pass
        logger.error("%s", message)
        self.wake_reader(message)

    @property
    def is_alive(self) -> bool:
        """Whether the engine process runs."""
        return self.proc.is_alive()

    def stop_process(self, timeout: float = 5.0, grace: float = 120.0) -> None:
        """Stop the engine process: SHUTDOWN (once ready), then SIGTERM, then SIGKILL.

        SHUTDOWN gets `grace` seconds: the engine finishes the program its background
        thread is compiling first (a process that exits during a compile aborts), which
        took over 5 s on a loaded 2-core machine and ended a clean stop with SIGTERM."""
        self.closing = True
        if self.proc.is_alive() and not self.ready_info:
            # Not ready (a start given up, e.g. its front end refused the config): nothing
            # to finish, and no socket peer yet to hear SHUTDOWN, which waited `timeout`
            # and then `grace` for an engine that went on loading.
            self.proc.terminate()
        elif self.proc.is_alive():
            # Blocking for up to `timeout`: right after READY the engine's end of the input
            # socket may still be connecting, and a non-blocking send found no peer, dropped
            # SHUTDOWN and left the process running until SIGTERM (`grace` seconds later).
            try:
                self.input_socket.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
                self.input_socket.send_multipart(
                    [RequestType.SHUTDOWN, *MsgpackEncoder().encode(None)]
                )
            except zmq.ZMQError:
                pass
            self.proc.join(grace)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)

    def wake_reader(self, message: str) -> None:
        """Push ENGINE_DEAD into our own output socket so a blocked reader returns."""
        push_engine_dead(self.ctx, self.output_address, message)

    def close_sockets(self) -> None:
        """Close the sockets and remove the socket directory."""
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def close(self) -> None:
        """Stop the process and release everything (also the GC finalizer)."""
        if self.ctx.closed:
            return
        self.stop_process()
        self.close_sockets()


def start_engine_process(engine_args: EngineArgs, log_stats: bool = True) -> _EngineProcess:
    """Spawn the engine process without waiting for it; `make_async_client(...,
    engine=...)` waits for its READY. The server starts it first thing, with the engine
    arguments the engine builds its config from, so the engine imports JAX and loads the
    model while the API server builds the same config and imports FastAPI and the
    handlers."""
    return _EngineProcess(engine_args, log_stats, EngineCoreProc, wait=False)


class _MPClientBase:
    """Shared set-up of the ZeroMQ clients.

    `engine_index`, `rank_env` and `rank_cpus`: the data-parallel rank this engine is
    (its outputs carry the index) and its process's environment and cores
    (`xlm.engine.dp_client` sets them). `engine`: an engine already started elsewhere
    (a rank on another host, `xlm.engine.dp_remote.RemoteEngine`) instead of spawning one."""

    def __init__(
        self,
        xlm_config: XlmConfig,
        log_stats: bool = True,
        engine_core_proc_class: type[EngineCoreProc] = EngineCoreProc,
        engine_index: int = 0,
        rank_env: dict[str, str] | None = None,
        rank_cpus: set[int] | None = None,
        engine: Any = None,
    ) -> None:
        self.xlm_config = xlm_config
        self.engine_index = engine_index
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder()
        self.engine = engine or _EngineProcess(
            xlm_config, log_stats, engine_core_proc_class, rank_env, rank_cpus
        )
        self.ready_info = self.engine.ready_info
        self._call_ids = itertools.count()
        self._finalizer = weakref.finalize(self, self.engine.close)

    @property
    def engine_dead(self) -> bool:
        """Whether the engine process has died or failed."""
        return self.engine.dead_message is not None or (
            not self.engine.closing and not self.engine.is_alive
        )

    @property
    def dead_message(self) -> str | None:
        """Why the engine died (None while it runs, or when it died without a word)."""
        return self.engine.dead_message

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine process is gone."""
        if self.engine_dead:
            raise EngineDeadError(self.engine.dead_message or "the engine core process is dead")

    def _frames(self, kind: bytes, payload: Any) -> list[Any]:
        return [kind, *self.encoder.encode(payload)]

    # -- what the engine sends back, routed the same way by both clients ------------------

    def _dispatch(self, frames: list[Any]) -> bool:
        """Route one message from the engine; False once the engine has failed."""
        kind, payload = frames[0].bytes, self.decoder.decode(frames[1:])
        if kind == OutputType.OUTPUTS:
            payload.engine_index = self.engine_index
            self._put_output(payload)
        elif kind == OutputType.QUEUE_TIMES:
            self._record_queue_times(payload)
        elif kind == OutputType.UTILITY_RESULT:
            call_id, ok, value = payload
            future = self._take_pending(call_id)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(RuntimeError(value))
        elif kind in (OutputType.ENGINE_ERROR, OutputType.ENGINE_DEAD):
            self._fail_all(payload)
            return False
        return True

    def _fail_all(self, message: str | None) -> None:
        """The engine is gone: fail every pending utility call and every output reader."""
        if message and self.engine.dead_message is None:
            self.engine.dead_message = message
        error = EngineDeadError(self.engine.dead_message or "the engine core process is dead")
        for future in self._take_all_pending():
            if not future.done():
                future.set_exception(error)
        self._put_output(error)

    def _put_output(self, item: Any) -> None:  # EngineCoreOutputs, or the error that ends them
        raise NotImplementedError

    def _record_queue_times(self, times: dict[str, float]) -> None:
        """Queue times the engine reports (only the server's front end keeps them)."""

    def _take_pending(self, call_id: int) -> Any:
        raise NotImplementedError

    def _take_all_pending(self) -> list[Any]:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the engine process."""
        self._finalizer()


class SyncMPClient(_MPClientBase):
    """Blocking client for LLMEngine; a reader thread routes outputs and utility results.

    `outputs_queue`: where outputs go (the data-parallel client gives its ranks one)."""

    def __init__(
        self, *args: Any, outputs_queue: queue.Queue[Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.outputs_queue: queue.Queue[Any] = (
            queue.Queue() if outputs_queue is None else outputs_queue
        )
        self._pending: dict[int, Future] = {}
        # The reader thread and any caller thread touch _pending.
        self._pending_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_outputs, daemon=True)
        self._reader.start()
        # Collected or at exit without shutdown(): the reader leaves its socket before the
        # context ends (a context ended under a reader blocked in recv never returns).
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop_sync_client, self.engine, self._reader)

    def _read_outputs(self) -> None:
        socket = self.engine.output_socket
        try:
            while self._dispatch(socket.recv_multipart(copy=False)):
                pass
        except zmq.ZMQError:
            self._fail_all(None)

    def _put_output(self, item: Any) -> None:
        self.outputs_queue.put(item)

    def _take_pending(self, call_id: int) -> Future | None:
        with self._pending_lock:
            return self._pending.pop(call_id, None)

    def _take_all_pending(self) -> list[Future]:
        with self._pending_lock:
            pending = list(self._pending.values())
            self._pending.clear()
        return pending

    def _send(self, kind: bytes, payload: Any) -> None:
        self.check_health()
        with self._send_lock:
            self.engine.input_socket.send_multipart(self._frames(kind, payload), copy=False)

    def get_output(self) -> EngineCoreOutputs:
        """Block until the next EngineCoreOutputs (EngineDeadError if the engine died)."""
        result = self.outputs_queue.get()
        if isinstance(result, BaseException):
            self.outputs_queue.put(result)  # every later caller fails the same way
            raise result
        return result

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a new EngineCoreRequest."""
        self._send(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in the core, freeing their blocks."""
        if request_ids:
            self._send(RequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any, timeout: float | None = 60.0) -> Any:
        """Call a method of the engine core in its process and return its result."""
        call_id = next(self._call_ids)
        future: Future = Future()
        with self._pending_lock:
            self._pending[call_id] = future
        try:
            self._send(RequestType.UTILITY, [call_id, method, list(args)])
            return future.result(timeout)
        finally:  # answered, timed out or failed: the entry goes either way
            with self._pending_lock:
                self._pending.pop(call_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache in the core."""
        return self.call_utility("reset_prefix_cache")

    def get_num_compilations(self) -> int:
        """Step programs the core compiled so far (flat after warm-up)."""
        return self.call_utility("get_num_compilations")

    def get_encoder_cache_stats(self) -> dict[str, int]:
        """The core's encoder cache hits and misses (images encoded)."""
        return self.call_utility("get_encoder_cache_stats")

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait for the core's background compilation (its loop waits with it)."""
        return self.call_utility("wait_for_programs", timeout, timeout=None)

    def get_stats(self) -> SchedulerStats:
        """The core's scheduler counters now."""
        return self.call_utility("make_stats")

    def shutdown(self) -> None:
        """Stop the engine process and the reader thread."""
        self._finalizer()


def _stop_sync_client(engine: _EngineProcess, reader: threading.Thread) -> None:
    """Stop a SyncMPClient's engine process, then its reader thread, then the sockets."""
    if engine.ctx.closed:
        return
    engine.stop_process()
    engine.wake_reader("the engine core was shut down")
    reader.join(timeout=5)
    engine.close()


class AsyncMPClient(_MPClientBase):
    """Asyncio client for AsyncLLM; a reader task routes outputs and utility results."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._actx = zmq.asyncio.Context.shadow(self.engine.ctx.underlying)
        self._input = zmq.asyncio.Socket.shadow(self.engine.input_socket.underlying)
        self._output = zmq.asyncio.Socket.shadow(self.engine.output_socket.underlying)
        self._outputs_queue: asyncio.Queue[Any] | None = None
        self._pending: dict[int, asyncio.Future] = {}
        # Queue times (s) the engine reported since the last pop_queue_times().
        self.queue_times: list[float] = []
        self._reader_task: asyncio.Task | None = None

    def _ensure_reader(self) -> asyncio.Queue[Any]:
        if self._outputs_queue is None:
            self._outputs_queue = asyncio.Queue()
            self._reader_task = asyncio.get_running_loop().create_task(self._read_outputs())
        return self._outputs_queue

    async def _read_outputs(self) -> None:
        try:
            while self._dispatch(await self._output.recv_multipart(copy=False)):
                pass
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail_all(f"engine output socket failed: {e}")

    def _put_output(self, item: Any) -> None:
        assert self._outputs_queue is not None
        self._outputs_queue.put_nowait(item)

    def _record_queue_times(self, times: dict[str, float]) -> None:
        self.queue_times.extend(times.values())

    def _take_pending(self, call_id: int) -> asyncio.Future | None:
        return self._pending.pop(call_id, None)

    def _take_all_pending(self) -> list[asyncio.Future]:
        pending = list(self._pending.values())
        self._pending.clear()
        return pending

    async def _send(self, kind: bytes, payload: Any) -> None:
        self._ensure_reader()
        self.check_health()
        await self._input.send_multipart(self._frames(kind, payload), copy=False)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next EngineCoreOutputs (EngineDeadError if the engine died)."""
        outputs_queue = self._ensure_reader()
        result = await outputs_queue.get()
        if isinstance(result, BaseException):
            outputs_queue.put_nowait(result)
            raise result
        return result

    def pop_queue_times(self) -> list[float]:
        """Queue times reported since the last call (read before each outputs batch)."""
        times, self.queue_times = self.queue_times, []
        return times

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Send a new EngineCoreRequest."""
        await self._send(RequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort requests in the core, freeing their blocks."""
        if request_ids:
            await self._send(RequestType.ABORT, list(request_ids))

    async def call_utility_async(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """Call a method of the engine core in its process and return its result."""
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            await self._send(RequestType.UTILITY, [call_id, method, list(args)])
            return await asyncio.wait_for(future, timeout)
        finally:  # answered, timed out or failed: the entry goes either way
            self._pending.pop(call_id, None)

    async def reset_prefix_cache_async(self) -> bool:
        """Forget the prefix cache in the core."""
        return await self.call_utility_async("reset_prefix_cache")

    def shutdown(self) -> None:
        """Stop the reader task and the engine process."""
        if self.engine.ctx.closed:
            return
        if self._reader_task is not None and not self._reader_task.done():
            self._reader_task.cancel()
        self.engine.stop_process()
        self._finalizer()
