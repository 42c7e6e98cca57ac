"""Executor for one model across hosts: `jax.distributed`, one process per host.

Every process drives its own devices of one global mesh and all run the same jitted
programs (SPMD). Process 0 (the leader) runs the EngineCore, the scheduler and the front
end; before each call on its worker (`execute_model`, `warmup`) it sends the same call
to every follower over the step channel, so the followers' workers keep identical
request state and enter every collective in the same order. Step inputs are built on
each process from that scheduler output (no device-to-device broadcast of inputs).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any

from xlm import envs
from xlm.config import ParallelConfig, XlmConfig
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.distributed.coordination import barrier
from xlm.executor.abstract import Executor
from xlm.executor.step_channel import HEARTBEAT_INTERVAL_S, FollowerChannel, LeaderChannel
from xlm.logger import init_logger

logger = init_logger(__name__)

_SHUTDOWN = "shutdown"
_CONFIG = "config"
_BARRIER = "barrier"
# Worker calls that may fail on user input, leaving the worker unchanged: a follower logs
# the error and goes on (the leader raises it to the caller).
_REFUSABLE = frozenset({"update_weights"})


def resolve_process_id(parallel_config: ParallelConfig) -> int | None:
    """This process's id: the option, else XLM_PROCESS_ID, else the pod's (LWS_WORKER_INDEX,
    TPU_WORKER_ID, JOB_COMPLETION_INDEX)."""
    if parallel_config.process_id is not None:
        return parallel_config.process_id
    process_id = envs.XLM_PROCESS_ID
    return process_id if process_id is not None else envs.pod_environment().process_id


def keep_stdout_for_python() -> None:
    """Point file descriptor 1 at stderr and give Python's `sys.stdout` the original.

    Gloo's C++ code (the CPU collectives of a multi-process run) prints its connection
    lines to fd 1, unsynchronised with Python: they landed inside `xlm generate`'s text,
    even mid-line. After this, native code writing to stdout writes to stderr, and what
    xlm prints (the product of `generate`, `plan`, ...) is the only thing on stdout.
    """
    if getattr(sys.stdout, "_xlm_own_fd", False):
        return
    sys.stdout.flush()
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    stream = os.fdopen(os.dup(1), "w", buffering=1, encoding=encoding, errors="replace")
    stream._xlm_own_fd = True  # type: ignore[attr-defined]
    os.dup2(2, 1)
    sys.stdout = stream


def initialize_distributed(parallel_config: ParallelConfig) -> None:
    """`jax.distributed.initialize` once per process (JAX detects what is left unset)."""
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return
    keep_stdout_for_python()
    start = time.perf_counter()
    jax.distributed.initialize(
        coordinator_address=parallel_config.coordinator_address,
        num_processes=parallel_config.num_processes,
        process_id=resolve_process_id(parallel_config),
        # Our own heartbeats end a process within XLM_MULTIHOST_HEARTBEAT_TIMEOUT_S;
        # JAX's are the backstop.
        heartbeat_timeout_seconds=max(30, int(3 * envs.XLM_MULTIHOST_HEARTBEAT_TIMEOUT_S)),
        shutdown_timeout_seconds=30,
    )
    logger.info(
        "jax.distributed: process %d of %d, %d local / %d global devices (%.1f s).",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        time.perf_counter() - start,
    )


def channel_address(parallel_config: ParallelConfig) -> tuple[str, int]:
    """(leader host, step-channel port): the coordinator's host, its port + 1."""
    address = parallel_config.coordinator_address
    if address is None:
        from jax._src import distributed

        address = distributed.global_state.coordinator_address
    if not address:
        raise ValueError(
            "coordinator_address=None: the multihost step channel needs the leader's "
            "'host:port' (--coordinator-address or XLM_COORDINATOR_ADDRESS)"
        )
    host, _, port = address.rpartition(":")
    return host, envs.XLM_MULTIHOST_PORT or int(port) + 1


class MultihostExecutor(Executor):
    """The leader's executor: mirrors every worker call to the followers, then runs it."""

    def __init__(self, config: XlmConfig) -> None:
        import jax

        super().__init__(config)
        initialize_distributed(config.parallel_config)
        if jax.process_index() != 0:
            raise RuntimeError(
                f"MultihostExecutor runs on process 0; this is process {jax.process_index()} "
                "(followers run xlm.executor.multihost.run_follower)"
            )
        host, port = channel_address(config.parallel_config)
        timeout = envs.XLM_MULTIHOST_HEARTBEAT_TIMEOUT_S
        self.channel = LeaderChannel(host, port, jax.process_count(), timeout)
        # Followers must hear the shutdown even when the front end never calls it
        # (`xlm generate`, a script that just ends): they then reach JAX's shutdown
        # barrier together with this process. Runs before JAX's own atexit handler.
        atexit.register(self.shutdown)
        # Followers build their worker from the leader's config, so every process
        # compiles the same programs.
        self.channel.send((_CONFIG, config))
        from xlm.worker.worker import Worker

        self.worker = Worker(config)
        self._call("warmup")
        self.channel.send((_BARRIER, ("ready",)))
        barrier("ready")

    def _call(self, method: str, *args: Any) -> Any:
        self.channel.send((method, args))
        try:
            return getattr(self.worker, method)(*args)
        except Exception:
            # A collective failing usually means a process died; give the heartbeat
            # monitor time to name it (it ends this process) before raising the raw error.
            time.sleep(envs.XLM_MULTIHOST_HEARTBEAT_TIMEOUT_S + 2 * HEARTBEAT_INTERVAL_S)
            raise

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", scheduler_output)

    def dispatch(self, scheduler_output: SchedulerOutput) -> None:
        self._call("dispatch", scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        return self._call("collect")

    def sleep(self, level: int) -> dict[str, int]:
        return self._call("sleep", level)

    def wake_up(self) -> None:
        self._call("wake_up")

    def update_weights(self, path: str) -> None:
        # Every process reads `path` itself (it must be visible on every host); a checkpoint
        # that does not fit is refused alike everywhere (see run_follower).
        self.channel.send(("update_weights", (path,)))
        self.worker.update_weights(path)

    def shutdown(self) -> None:
        channel, self.channel = getattr(self, "channel", None), None
        if channel is not None:
            channel.send((_SHUTDOWN, ()))
            channel.close()


def run_follower(parallel_config: ParallelConfig) -> None:
    """A follower process: join the leader, then mirror its worker calls until shutdown."""
    import jax

    initialize_distributed(parallel_config)
    process_id = jax.process_index()
    host, port = channel_address(parallel_config)
    channel = FollowerChannel(host, port, process_id, envs.XLM_MULTIHOST_HEARTBEAT_TIMEOUT_S)
    kind, config = channel.recv()
    assert kind == _CONFIG, kind
    from xlm.worker.worker import Worker

    worker = Worker(config)
    logger.info("multihost: follower process %d ready.", process_id)
    steps = 0
    while True:
        method, args = channel.recv()
        if method == _SHUTDOWN:
            break
        if method == _BARRIER:
            barrier(*args)
            continue
        try:
            getattr(worker, method)(*args)
        except ValueError as e:
            if method not in _REFUSABLE:
                raise
            # The leader refuses the same call for the same reason; both stay as they were.
            logger.warning("multihost: follower %d refused %s: %s", process_id, method, e)
        steps += 1
    logger.info("multihost: leader shut down after %d calls; follower %d exits.", steps, process_id)
    channel.close()


def is_follower(parallel_config: ParallelConfig) -> bool:
    """Whether this process of a multihost engine follows (known without starting JAX)."""
    if not parallel_config.is_multihost:
        return False
    process_id = resolve_process_id(parallel_config)
    if process_id is None:
        raise ValueError(
            "process_id=None: multihost needs each process's id (--process-id, "
            "XLM_PROCESS_ID, or the pod's TPU_WORKER_ID, JOB_COMPLETION_INDEX or "
            "LWS_WORKER_INDEX)"
        )
    return process_id != 0


def follow_if_follower(parallel_config: ParallelConfig) -> None:
    """On a follower: run the follower loop, then exit the process (status 0)."""
    if is_follower(parallel_config):
        run_follower(parallel_config)
        sys.exit(0)
