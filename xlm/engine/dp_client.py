"""Data parallelism at the client: N engine cores behind one front end.

Each data-parallel rank is an engine core of its own (`EngineCoreProc`, its own process)
on its own device group, a tensor-parallel mesh of `tensor_parallel_size` devices; its
platform shows the process only those devices (`Platform.data_parallel_env`) and, on CPU,
pins it to its share of the cores. The clients here hold one multiprocess client per rank
and look like one engine to `LLMEngine` (`DPSyncMPClient`) and `AsyncLLM`
(`DPAsyncMPClient`).

`DataParallelRouter` (xlm.engine.dp_router) picks each request's rank by prefix affinity
and load. KV events are on by default: the client gives its ranks an events config of its
own when the user gave none (`router_kv_events_config`), each rank publishes on its own
endpoint (`KVEventsConfig.for_rank`; a rank on another host on its host's tcp endpoint,
sent when it registers: xlm.engine.dp_remote), and the client follows all of them into the
router's `PrefixCacheIndex` (xlm.engine.kv_events_subscriber). A rank that dies fails only its own
requests (finish reason "error"); the others keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import queue
import secrets
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from xlm import envs
from xlm.config import KVEventsConfig, XlmConfig
from xlm.core.outputs import EngineCoreOutput, SchedulerStats
from xlm.engine.core_proc import EngineCoreProc
from xlm.engine.dp_remote import RankRegistry, RemoteEngine, rank_config
from xlm.engine.dp_router import DataParallelRouter, affinity_slack
from xlm.engine.exceptions import EngineDeadError
from xlm.engine.kv_events_subscriber import KVEventSubscriber, PrefixCacheIndex
from xlm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from xlm.engine.mp_client import AsyncMPClient, SyncMPClient
from xlm.logger import init_logger

logger = init_logger(__name__)


def router_kv_events_config(xlm_config: XlmConfig) -> KVEventsConfig | None:
    """The KV events the router subscribes to: the user's config when it publishes, one of
    the router's own (an ipc endpoint in the temp dir) when the user gave none, None (no
    events: first-block affinity) when the user's config turns them off."""
    config = xlm_config.kv_events_config
    if config is not None:
        return config if config.publishes else None
    name = f"xlm-kv-events-{os.getpid()}-{secrets.token_hex(4)}"
    return KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"ipc://{os.path.join(tempfile.gettempdir(), name)}"
    )


def _start_engines(
    client_class: type,
    xlm_config: XlmConfig,
    kv_events: KVEventsConfig | None = None,
    rank_kwargs: Callable[[int], dict[str, Any]] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Start one client (and engine process) per rank, all at once; all or none.
    `kv_events`: the events config of all ranks (each local rank publishes on its own
    endpoint; a remote rank on its host's, which it sends when it registers);
    `rank_kwargs(rank)`: more client arguments of one rank."""
    from xlm.platforms import current_platform

    parallel = xlm_config.parallel_config
    dp, tp = parallel.data_parallel_size, parallel.tensor_parallel_size
    start_rank, local = parallel.data_parallel_start_rank, parallel.data_parallel_local_size
    # Ranks on other hosts register with us over TCP (xlm serve --headless there).
    remote = {
        rank: RemoteEngine(rank, parallel.data_parallel_address or "127.0.0.1")
        for rank in range(dp)
        if not start_rank <= rank < start_rank + local
    }
    registry = (
        RankRegistry(
            parallel.data_parallel_address or "", parallel.data_parallel_rpc_port or 0, remote
        )
        if remote
        else None
    )

    def start(rank: int) -> Any:
        if rank in remote:
            remote[rank].wait_until_ready(envs.XLM_ENGINE_READY_TIMEOUT_S or 600.0)
            place: dict[str, Any] = {"engine": remote[rank]}
        else:
            index = rank - start_rank
            place = {
                "rank_env": current_platform.data_parallel_env(index, tp),
                "rank_cpus": current_platform.data_parallel_cpus(index, local),
            }
        return client_class(
            rank_config(xlm_config, rank, kv_events),
            engine_index=rank,
            **place,
            **kwargs,
            **(rank_kwargs(rank) if rank_kwargs else {}),
        )

    with ThreadPoolExecutor(max_workers=dp, thread_name_prefix="xlm-dp-start") as pool:
        futures = [pool.submit(start, rank) for rank in range(dp)]
        if any(f.exception() for f in wait(futures, return_when=FIRST_EXCEPTION).done):
            for engine in remote.values():  # no use waiting for the others to register
                engine.cancelled.set()
        engines, error = [], None
        for future in futures:
            try:
                engines.append(future.result())
            except BaseException as e:  # the others started: stop them, report the first
                error = error or e
    if registry is not None:
        registry.close()
    if error is not None:
        for engine in remote.values():
            engine.close()
        for engine in engines:
            engine.shutdown()
        raise error
    return engines


def merge_ready_info(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One READY view of all ranks: the smallest capacities, every rank's pid."""
    merged = dict(infos[0])
    for key in ("max_model_len", "num_blocks", "kv_cache_tokens"):
        values = [info[key] for info in infos if info.get(key)]
        if values:
            merged[key] = min(values)
    merged["pids"] = [info.get("pid") for info in infos]
    merged["data_parallel_size"] = len(infos)
    return merged


def merge_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """All ranks' scheduler stats as one: counts summed, KV cache usage averaged."""
    merged = SchedulerStats()
    for f in dataclasses.fields(SchedulerStats):
        values = [getattr(s, f.name) for s in stats]
        total = sum(values)
        setattr(merged, f.name, total / len(values) if f.name == "kv_cache_usage" else total)
    return merged


class _RankQueue:
    """One rank's view of the shared outputs queue: what it puts is tagged with its rank."""

    def __init__(self, shared: queue.Queue[tuple[int, Any]], rank: int) -> None:
        self.shared, self.rank = shared, rank

    def put(self, item: Any) -> None:
        """Queue one item of this rank."""
        self.shared.put((self.rank, item))


class _DPClientBase:
    """What both data-parallel clients share: the engines, the router, per-rank state."""

    engines: list[Any]

    def _init_router(self, xlm_config: XlmConfig) -> None:
        self.xlm_config = xlm_config
        dp = xlm_config.parallel_config.data_parallel_size
        self.kv_events_config = router_kv_events_config(xlm_config)
        self.router = DataParallelRouter(
            dp,
            xlm_config.cache_config.block_size,
            affinity_slack(xlm_config.scheduler_config.max_num_seqs),
            None if self.kv_events_config is None else PrefixCacheIndex(dp),
        )
        self.kv_event_subscriber: KVEventSubscriber | None = None

    def _subscribe_kv_events(self) -> None:
        """Once every rank is up: follow each rank's KV events into the router's index."""
        events, index = self.kv_events_config, self.router.prefix_index
        if events is None or index is None:
            return
        endpoints = [
            engine.engine.kv_events_endpoint  # its host's, sent when it registered
            if isinstance(engine.engine, RemoteEngine)
            else events.for_rank(rank).connect_endpoint
            for rank, engine in enumerate(self.engines)
        ]
        self.kv_event_subscriber = KVEventSubscriber(endpoints, events.topic, index)

    def _stop_kv_events(self) -> None:
        if self.kv_event_subscriber is not None:
            self.kv_event_subscriber.shutdown()
            self.kv_event_subscriber = None
        events = self.kv_events_config
        if events is not None and self.xlm_config.kv_events_config is None:
            # The router's own ipc endpoints: their socket files go with the ranks.
            for rank in range(self.xlm_config.parallel_config.data_parallel_size):
                with contextlib.suppress(OSError):
                    os.unlink(events.for_rank(rank).endpoint[len("ipc://") :])

    @property
    def dead_engines(self) -> list[int]:
        """Ranks whose engine died."""
        return [
            r
            for r, engine in enumerate(self.engines)
            if engine.engine_dead or not self.router.alive[r]
        ]

    @property
    def engine_dead(self) -> bool:
        """Whether every rank's engine died (then the whole front end is dead)."""
        return len(self.dead_engines) == len(self.engines)

    @property
    def dead_message(self) -> str | None:
        """Why the dead ranks died."""
        messages = [
            f"engine {r}: {self.engines[r].dead_message or 'its process is dead'}"
            for r in self.dead_engines
        ]
        return "; ".join(messages) or None

    def check_health(self) -> None:
        """Raise EngineDeadError when no rank is left."""
        if self.engine_dead:
            raise EngineDeadError(self.dead_message or "every data-parallel engine is dead")

    def _on_engine_dead(self, rank: int, message: str) -> None:
        """Fail the rank's requests in flight (finish reason "error"); the front end dies
        with the last rank."""
        if rank in self._reported_dead:
            return
        self._reported_dead.add(rank)
        lost = self.router.mark_dead(rank)
        logger.error(
            "Data-parallel engine %d died (%s); %d request(s) on it failed, %d rank(s) serve",
            rank,
            message,
            len(lost),
            len(self.engines) - len(self._reported_dead),
        )
        if lost:
            reason = f"data-parallel engine {rank} died: {message}"
            failed = [
                EngineCoreOutput(r, [], finish_reason="error", stop_reason=reason) for r in lost
            ]
            self._deliver(EngineCoreOutputs(failed, None, time.time(), rank))
        if len(self._reported_dead) == len(self.engines):
            self._deliver(EngineDeadError(self.dead_message or message))

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        """Queue outputs (or the error that ends them) for the reader."""
        raise NotImplementedError

    def _live_engines(self) -> list[Any]:
        """The engines of the ranks still serving."""
        return [e for r, e in enumerate(self.engines) if self.router.alive[r] and not e.engine_dead]

    def _choose_live(self, request: EngineCoreRequest) -> int:
        """The router's rank for a request, skipping ranks found dead meanwhile."""
        while True:
            rank = self.router.choose(request)  # EngineDeadError when none is left
            if not self.engines[rank].engine_dead:
                return rank
            self.router.finish(request.request_id)
            self._on_engine_dead(rank, self.engines[rank].dead_message or "its process exited")

    def _note_finished(self, outputs: EngineCoreOutputs) -> None:
        for output in outputs.outputs:
            if output.finished:
                self.router.finish(output.request_id)

    def _group_by_rank(self, request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.router.rank_of(request_id)
            if rank is not None:
                groups.setdefault(rank, []).append(request_id)
            self.router.finish(request_id)
        return {r: ids for r, ids in groups.items() if self.router.alive[r]}


class DPSyncMPClient(_DPClientBase):
    """Blocking data-parallel client for LLMEngine (`LLM(data_parallel_size=N)`): one
    shared outputs queue that every rank's reader thread feeds."""

    def __init__(
        self,
        xlm_config: XlmConfig,
        log_stats: bool = True,
        engine_core_proc_class: type[EngineCoreProc] = EngineCoreProc,
    ) -> None:
        self._init_router(xlm_config)
        # (rank, item): a rank's outputs or the error that ended it; rank -1: ours.
        self.outputs_queue: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.engines: list[SyncMPClient] = _start_engines(
            SyncMPClient,
            xlm_config,
            self.kv_events_config,
            log_stats=log_stats,
            engine_core_proc_class=engine_core_proc_class,
            rank_kwargs=lambda rank: {"outputs_queue": _RankQueue(self.outputs_queue, rank)},
        )
        self.ready_info = merge_ready_info([e.ready_info for e in self.engines])
        self._reported_dead: set[int] = set()
        self._subscribe_kv_events()

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self.outputs_queue.put((-1, item))

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the rank the router picks (a live one)."""
        rank = self._choose_live(request)
        try:
            self.engines[rank].add_request(request)
        except BaseException:
            self.router.finish(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests on the ranks they run on."""
        for rank, ids in self._group_by_rank(list(request_ids)).items():
            self.engines[rank].abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        """The next outputs of any rank. A rank that died fails its requests in flight
        (finish reason "error"); EngineDeadError once every rank died."""
        while True:
            rank, item = self.outputs_queue.get()
            if isinstance(item, BaseException):
                if rank >= 0:  # one rank's end: its requests fail, the others go on
                    self._on_engine_dead(rank, str(item))
                    continue
                self.outputs_queue.put((rank, item))  # every later caller fails the same way
                raise item
            if rank >= 0 and rank in self._reported_dead:
                continue  # a dead rank's last outputs: its requests already failed
            self._note_finished(item)
            return item

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call an engine-core method on every live rank; the first one's result."""
        return [engine.call_utility(method, *args) for engine in self._live_or_raise()][0]

    def _live_or_raise(self) -> list[SyncMPClient]:
        live = self._live_engines()
        if not live:
            raise EngineDeadError(self.dead_message or "every data-parallel engine is dead")
        return live

    def reset_prefix_cache(self) -> bool:
        """Forget every live rank's prefix cache."""
        return all([engine.reset_prefix_cache() for engine in self._live_or_raise()])

    def get_num_compilations(self) -> int:
        """Step programs compiled by the live ranks together (flat after warm-up)."""
        return sum(engine.get_num_compilations() for engine in self._live_or_raise())

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait for every live rank's background compilation."""
        return all([engine.wait_for_programs(timeout) for engine in self._live_or_raise()])

    def get_stats(self) -> SchedulerStats:
        """All ranks' scheduler counters together."""
        return merge_stats(self.get_stats_per_engine())

    def get_stats_per_engine(self) -> list[SchedulerStats]:
        """Each rank's scheduler counters, by rank (zeros for a dead rank)."""
        live = self._live_engines()
        return [
            engine.get_stats() if engine in live else SchedulerStats() for engine in self.engines
        ]

    def shutdown(self) -> None:
        """Stop every rank's engine process."""
        self._stop_kv_events()
        for engine in self.engines:
            engine.shutdown()


class DPAsyncMPClient(_DPClientBase):
    """Asyncio data-parallel client for AsyncLLM (the server): one task per rank moves
    that rank's outputs into one queue; a rank that dies fails its requests only."""

    def __init__(
        self,
        xlm_config: XlmConfig,
        log_stats: bool = True,
        engine_core_proc_class: type[EngineCoreProc] = EngineCoreProc,
    ) -> None:
        self._init_router(xlm_config)
        self.engines: list[AsyncMPClient] = _start_engines(
            AsyncMPClient,
            xlm_config,
            self.kv_events_config,
            log_stats=log_stats,
            engine_core_proc_class=engine_core_proc_class,
        )
        self.ready_info = merge_ready_info([e.ready_info for e in self.engines])
        self._subscribe_kv_events()
        self._outputs: asyncio.Queue[Any] | None = None
        self._pumps: list[asyncio.Task] = []
        self._queue_times: list[float] = []
        self._reported_dead: set[int] = set()

    def _ensure_pumps(self) -> asyncio.Queue[Any]:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
            loop = asyncio.get_running_loop()
            self._pumps = [loop.create_task(self._pump(r)) for r in range(len(self.engines))]
        return self._outputs

    async def _pump(self, rank: int) -> None:
        engine = self.engines[rank]
        try:
            while True:
                outputs = await engine.get_output_async()
                assert self._outputs is not None
                self._outputs.put_nowait((outputs, engine.pop_queue_times()))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._on_engine_dead(rank, str(e))

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        queue_ = self._ensure_pumps()
        queue_.put_nowait(item if isinstance(item, BaseException) else (item, []))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs of any rank (their `engine_index` names it)."""
        outputs_queue = self._ensure_pumps()
        item = await outputs_queue.get()
        if isinstance(item, BaseException):
            outputs_queue.put_nowait(item)
            raise item
        outputs, self._queue_times = item
        self._note_finished(outputs)
        return outputs

    def pop_queue_times(self) -> list[float]:
        """Queue times of the outputs get_output_async returned last."""
        times, self._queue_times = self._queue_times, []
        return times

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Send a request to the rank the router picks (a live one)."""
        self._ensure_pumps()
        rank = self._choose_live(request)
        try:
            await self.engines[rank].add_request_async(request)
        except BaseException:
            self.router.finish(request.request_id)
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort requests on the ranks they run on."""
        for rank, ids in self._group_by_rank(list(request_ids)).items():
            await self.engines[rank].abort_requests_async(ids)

    async def call_utility_async(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """Call an engine-core method on every live rank; the first rank's result."""
        live = self._live_engines()
        if not live:
            raise EngineDeadError(self.dead_message or "every data-parallel engine is dead")
        results = await asyncio.gather(
            *(e.call_utility_async(method, *args, timeout=timeout) for e in live)
        )
        return results[0]

    async def reset_prefix_cache_async(self) -> bool:
        """Forget every live rank's prefix cache."""
        live = self._live_engines()
        return all(await asyncio.gather(*(e.reset_prefix_cache_async() for e in live)))

    def shutdown(self) -> None:
        """Stop the pump tasks and every rank's engine process."""
        for task in self._pumps:
            if not task.done():
                task.cancel()
        self._stop_kv_events()
        for engine in self.engines:
            engine.shutdown()


def make_async_client(xlm_config: XlmConfig, log_stats: bool = True, engine: Any = None) -> Any:
    """The server's engine client: one engine process, or one per data-parallel rank.

    `engine`: a process `start_engine_process` already spawned (one rank): waited for
    here, and stopped if it fails to start."""
    if engine is not None:
        engine.wait_until_ready()
        return AsyncMPClient(xlm_config, log_stats, engine=engine)
    if xlm_config.parallel_config.data_parallel_size > 1:
        return DPAsyncMPClient(xlm_config, log_stats)
    return AsyncMPClient(xlm_config, log_stats)
