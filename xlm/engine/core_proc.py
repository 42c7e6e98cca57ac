"""EngineCoreProc: an EngineCore in its own process, fed and drained over ZeroMQ.

Three threads in the engine process: the input IO thread reads and decodes messages
from the client into a queue; the main thread runs the busy loop (drain the queue,
step while there is work, block on the queue when idle); the output IO thread encodes
what the busy loop produced and sends it. Decoding and encoding thereby overlap the
device steps. The messages are in `xlm/engine/messages.py`. The client binds both
sockets; the engine connects.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from xlm import envs
from xlm.config import XlmConfig
from xlm.core.outputs import EngineCoreOutput
from xlm.engine.arg_utils import EngineArgs
from xlm.engine.core import EngineCore
from xlm.engine.messages import EngineCoreOutputs, EngineCoreRequest, OutputType, RequestType
from xlm.engine.serial import MsgpackDecoder, MsgpackEncoder
from xlm.executor.abstract import Executor
from xlm.logger import init_logger
from xlm.metrics import startup

logger = init_logger(__name__)

# Engine-core methods a client may not call through UTILITY messages (the busy loop owns
# them); any other public method of EngineCore may be called ("ping" answers True).
_NOT_UTILITIES = frozenset({"add_request", "abort_requests", "step", "shutdown"})


def error_file_path(output_address: str) -> str | None:
    """Where a failing engine leaves its error, beside its ipc sockets (None over TCP: a
    rank on another host reports only through its socket)."""
    if not output_address.startswith("ipc://"):
        return None
    return os.path.join(os.path.dirname(output_address.removeprefix("ipc://")), "engine_error")


def _write_error_file(output_address: str, message: str) -> None:
    """Leave `message` where the client looks for a failed engine's error (best effort)."""
    path = error_file_path(output_address)
    try:
        if path is not None:
            with open(path, "w") as f:
                f.write(message)
    except OSError:
        pass


def _config_of(engine_args: EngineArgs, output_address: str) -> XlmConfig:
    """The config an engine spawned with its EngineArgs builds. A refused one exits
    quietly: the parent builds the same and reports it; should the parent's succeed, it
    finds the reason in the error file (`_EngineProcess`'s wait for READY)."""
    try:
        with startup.phase("config"):
            return engine_args.create_config()
    except Exception as e:
        _write_error_file(output_address, f"engine core process: configuration refused: {e}")
        os._exit(1)


class EngineCoreProc(EngineCore):
    """An EngineCore that adds the socket loop: IO threads plus a busy loop.

    Test doubles subclass it with a stand-in core mixed in after it (see
    tests/engine/fake_core.py); `run_engine_core` takes the class to start.
    """

    def __init__(
        self,
        config: XlmConfig,
        input_address: str,
        output_address: str,
        log_stats: bool = True,
        executor_class: type[Executor] | None = None,
    ) -> None:
        self._output_address = output_address
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[bytes, Any] | None] = queue.Queue()
        self._ctx = zmq.Context()
        # The output thread starts first so that a failing start can still report why.
        self._output_thread = threading.Thread(
            target=self._process_output_socket, args=(output_address,), daemon=True
        )
        self._output_thread.start()
        try:
            super().__init__(config, log_stats=log_stats, executor_class=executor_class)
        except BaseException:
            self._send_error("engine core failed to start:\n" + traceback.format_exc())
            raise
        self.output_queue.put((OutputType.READY, {"pid": os.getpid(), **self.get_ready_info()}))
        self._input_thread = threading.Thread(
            target=self._process_input_socket, args=(input_address,), daemon=True
        )
        self._input_thread.start()
        self._stats_dirty = False
        # (ready, registered) in the last idle stats; while some are not ready, the first
        # idle stats go out at once (/metrics shows readiness before any request).
        ready = self.programs_ready()
        self._programs_reported = (-1, -1) if ready[0] != ready[1] else ready
        # Admission time of requests not yet scheduled (for the queue-time histogram).
        self._waiting_since: dict[str, float] = {}

    # ---- busy loop --------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        """Drain inputs, step while there is work, block when idle; until SHUTDOWN."""
        while True:
            if not self.has_unfinished_requests() and self.input_queue.empty():
                ready = self.programs_ready()
                if self._stats_dirty or ready != self._programs_reported:
                    self._programs_reported = ready
                    self._send_idle_stats()
                try:  # while programs compile in the background, wake to report them
                    item = self.input_queue.get(timeout=None if ready[0] == ready[1] else 1.0)
                except queue.Empty:
                    continue
                if self._handle(*item):
                    return
            while True:
                try:
                    item = self.input_queue.get_nowait()
                except queue.Empty:
                    break
                if self._handle(*item):
                    return
            if self.has_unfinished_requests():
                step_start = time.monotonic()
                outputs = self.step()
                if self._waiting_since:
                    queue_times = self._take_queue_times(step_start)
                    if queue_times:
                        self.output_queue.put((OutputType.QUEUE_TIMES, queue_times))
                self.output_queue.put((OutputType.OUTPUTS, outputs))
                self._stats_dirty = True

    def _take_queue_times(self, step_start: float) -> dict[str, float]:
        """Queue times of requests this step scheduled for the first time."""
        out = {}
        for request_id, since in list(self._waiting_since.items()):
            if not self.is_request_waiting(request_id):
                del self._waiting_since[request_id]
                out[request_id] = max(step_start - since, 0.0)
        return out

    def _handle(self, kind: bytes, payload: Any) -> bool:
        """Apply one input message; True on SHUTDOWN."""
        if kind == RequestType.ADD:
            try:
                self.add_request(payload)
                self._waiting_since[payload.request_id] = time.monotonic()
            except Exception as e:  # per-request failure: only this request fails
                logger.warning("Request %s failed: %s", payload.request_id, e)
                self._send_request_error(payload, str(e))
        elif kind == RequestType.ABORT:
            self.abort_requests(payload)
            for request_id in payload:
                self._waiting_since.pop(request_id, None)
            self._stats_dirty = True
        elif kind == RequestType.UTILITY:
            call_id, method, args = payload
            try:
                value = self._call_utility(method, args)
                result = (call_id, True, value)
            except Exception as e:
                result = (call_id, False, f"{type(e).__name__}: {e}")
            self.output_queue.put((OutputType.UTILITY_RESULT, result))
        elif kind == RequestType.SHUTDOWN:
            return True
        else:
            logger.error("Unknown message type %r from the client", kind)
        return False

    def _call_utility(self, method: str, args: list[Any]) -> Any:
        """Call a public EngineCore method by name (not the busy loop's own)."""
        if method == "ping":
            return True
        if (
            method.startswith("_")
            or method in _NOT_UTILITIES
            or method in vars(EngineCoreProc)
            or not callable(getattr(self, method, None))
        ):
            raise ValueError(f"{method!r} cannot be called as a utility")
        return getattr(self, method)(*args)

    def _send_request_error(self, request: EngineCoreRequest, message: str) -> None:
        output = EngineCoreOutput(
            request.request_id, [], finish_reason="error", stop_reason=message
        )
        outputs = EngineCoreOutputs([output], self.make_stats(), time.time())
        self.output_queue.put((OutputType.OUTPUTS, outputs))

    def _send_idle_stats(self) -> None:
        self._stats_dirty = False
        outputs = EngineCoreOutputs([], self.make_stats(), time.time())
        self.output_queue.put((OutputType.OUTPUTS, outputs))

    def _send_error(self, message: str) -> None:
        self.output_queue.put((OutputType.ENGINE_ERROR, message))
        # Also on disk: the process exits right after, and ZeroMQ may not have sent it yet.
        _write_error_file(self._output_address, message)

    # ---- IO threads -------------------------------------------------------------------

    def _process_input_socket(self, address: str) -> None:
        decoder = MsgpackDecoder()
        socket = self._ctx.socket(zmq.PULL)
        socket.connect(address)
        try:
            while True:
                frames = socket.recv_multipart(copy=False)
                kind = frames[0].bytes
                try:
                    payload = decoder.decode(frames[1:])
                except Exception as e:  # a bad message is dropped; the engine keeps serving
                    logger.error("Dropped a %r message the engine cannot decode: %s", kind, e)
                    continue
                self.input_queue.put((kind, payload))
                if kind == RequestType.SHUTDOWN:
                    return
        except zmq.ContextTerminated:
            return
        except Exception:
            logger.exception("Input thread failed")
            self.input_queue.put((RequestType.SHUTDOWN, None))
        finally:
            socket.close(linger=0)

    def _process_output_socket(self, address: str) -> None:
        encoder = MsgpackEncoder()
        socket = self._ctx.socket(zmq.PUSH)
        socket.connect(address)
        try:
            while True:
                item = self.output_queue.get()
                if item is None:
                    return
                kind, payload = item
                socket.send_multipart([kind, *encoder.encode(payload)], copy=False)
        finally:
            socket.close(linger=2000)

    def shutdown(self) -> None:
        """Stop the core and flush pending outputs."""
        super().shutdown()
        self.output_queue.put(None)
        self._output_thread.join(timeout=5)

    # ---- process entry point ----------------------------------------------------------

    @classmethod
    def run_engine_core(
        cls,
        config: XlmConfig | EngineArgs,
        input_address: str,
        output_address: str,
        log_stats: bool = True,
        parent_pid: int | None = None,
        rank_env: dict[str, str] | None = None,
        rank_cpus: set[int] | None = None,
    ) -> None:
        """Entry point of the engine process (spawn target): start `cls`, run it.

        `rank_env` and `rank_cpus` (a data-parallel rank's, from its platform) are applied
        first, before JAX starts: its visible devices and the cores it runs on."""
        envs.set_variables(rank_env or {})
        if rank_cpus:
            os.sched_setaffinity(0, rank_cpus)
        # The front end handles Ctrl-C and tells us to stop; SIGTERM stops us cleanly.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        proc: EngineCoreProc | None = None
        stop = threading.Event()

        def on_sigterm(signum: int, frame: Any) -> None:
            if proc is not None:
                proc.input_queue.put((RequestType.SHUTDOWN, None))
            else:
                # Given up before READY: nothing to hand back, so leave at once. Raising
                # SystemExit here printed a traceback when the signal landed inside a
                # callback (JAX's gc hook) or inside the engine's construction.
                sys.stderr.flush()
                os._exit(0)

        signal.signal(signal.SIGTERM, on_sigterm)
        if parent_pid is not None:
            threading.Thread(target=_watch_parent, args=(parent_pid, stop), daemon=True).start()
        startup.begin()
        if isinstance(config, EngineArgs):  # spawned before the parent built its config
            config = _config_of(config, output_address)
        try:
            proc = cls(config, input_address, output_address, log_stats)
            startup.report("Engine core process")
        except BaseException:
            logger.exception("Engine core failed to start")
            time.sleep(0.5)  # let the output thread send the error
            os._exit(1)
        try:
            proc.run_busy_loop()
        except BaseException:
            logger.exception("Engine core failed while running")
            proc._send_error("engine core failed:\n" + traceback.format_exc())
            proc.output_queue.put(None)
            proc._output_thread.join(timeout=5)
            os._exit(1)
        stop.set()
        proc.shutdown()
        logger.info("Engine core process %d exiting", os.getpid())


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """Exit when the front-end process is gone (killed without a chance to stop us)."""
    while not stop.wait(1.0):
        if os.getppid() != parent_pid:
            logger.error("Front-end process %d is gone; engine core exiting", parent_pid)
            os._exit(1)
