"""AsyncLLM: the asyncio front end of the engine, used by the OpenAI server.

The engine core runs in its own process (AsyncMPClient). `generate()` turns a prompt
into an EngineCoreRequest (Processor), registers it with the OutputProcessor, sends it
to the core, and yields RequestOutputs from a per-request queue. One background task
reads EngineCoreOutputs, detokenizes them in chunks (yielding to the event loop between
chunks), routes RequestOutputs to their queues, aborts requests a stop string finished,
and feeds the stat loggers. Cancelling a generator (client disconnect) aborts its
request in the core, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from xlm.config import XlmConfig
from xlm.engine.dp_client import make_async_client
from xlm.engine.exceptions import EngineDeadError, RequestAbortedError
from xlm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from xlm.engine.mp_client import AsyncMPClient
from xlm.engine.output_processor import OutputProcessor
from xlm.engine.processor import Processor
from xlm.logger import init_logger
from xlm.lora.request import LoRARequest
from xlm.metrics import startup
from xlm.metrics.loggers import StatLoggerBase
from xlm.metrics.stats import RequestStatsTracker
from xlm.outputs import PoolingRequestOutput, RequestOutput
from xlm.pooling_params import PoolingParams
from xlm.sampling_params import MAX_DEVICE_LOGPROBS, SamplingParams
from xlm.tokenizer import get_tokenizer

logger = init_logger(__name__)

# EngineCoreOutputs are detokenized this many at a time before yielding to the loop.
OUTPUT_CHUNK_SIZE = 128


class RequestOutputCollector:
    """Queue of one request's outputs (or the error that ended it)."""

    __slots__ = ("items", "ready")

    def __init__(self) -> None:
        self.items: list[RequestOutput | BaseException] = []
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Add an output or an error."""
        self.items.append(item)
        self.ready.set()

    async def get(self) -> RequestOutput:
        """The next output; raises the error put instead of one."""
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLM:
    """Async engine front end: per-request streams over an engine-core process."""

    def __init__(
        self,
        xlm_config: XlmConfig | None,
        *,
        log_stats: bool = True,
        stat_loggers: list[StatLoggerBase] | None = None,
        engine_core_client: AsyncMPClient | None = None,
        tokenizer: Any | None = None,
        processor: Any | None = None,
        output_processor: Any | None = None,
        max_logprobs: int = MAX_DEVICE_LOGPROBS,
        engine_process: Any = None,
    ) -> None:
        startup.begin()
        self.xlm_config = xlm_config
        self.log_stats = log_stats
        self.stat_loggers: list[StatLoggerBase] = list(stat_loggers or [])
        # Start the engine process first (or wait for `engine_process`, one the server
        # spawned before its imports): it loads the model while nothing else waits, and
        # its READY message carries the context length the core settled on.
        if engine_process is not None and engine_core_client is None and tokenizer is None:
            # The engine loads meanwhile: the tokenizer's imports (transformers, seconds)
            # overlap it instead of following its READY; the processor reuses it (cached).
            with startup.phase("tokenizer"):
                try:
                    _load_tokenizer(xlm_config)
                except BaseException:
                    engine_process.close()
                    raise
        with startup.phase("engine core process"):
            self.engine_core = engine_core_client or make_async_client(
                xlm_config, log_stats, engine=engine_process
            )
        ready = self.engine_core.ready_info
        # The core settled the context length (the model's limit): the front end follows.
        if ready.get("max_model_len") and xlm_config is not None:
            xlm_config.set_max_model_len(int(ready["max_model_len"]))
        self.ready_info = ready
        try:
            with startup.phase("tokenizer"):
                self.processor = processor or _make_processor(xlm_config, max_logprobs)
            self.tokenizer = tokenizer or getattr(self.processor, "tokenizer", None)
            if output_processor is None:
                output_processor = OutputProcessor(self.tokenizer)
            self.output_processor = output_processor
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.collectors: dict[str, RequestOutputCollector] = {}
        # Front-end request id -> the ids its parts carry in the core (n > 1 fans out).
        self.core_ids: dict[str, list[str]] = {}
        self.stats_tracker = RequestStatsTracker()
        self.last_scheduler_stats: Any = None
        self.dead_error: EngineDeadError | None = None
        self._output_handler: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        # Whether the engine sleeps, as this client last set or read it (the server answers
        # new requests 503 meanwhile).
        self.sleeping = False
        startup.report("API server engine client")

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> AsyncLLM:
        """Build the config from EngineArgs and start the engine process."""
        return cls(engine_args.create_config(), **kwargs)

    @classmethod
    def from_config(cls, xlm_config: Any, **kwargs: Any) -> AsyncLLM:
        """Start the engine process for a config."""
        return cls(xlm_config, **kwargs)

    # ---- requests ---------------------------------------------------------------------

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's RequestOutputs (DELTA, CUMULATIVE or FINAL_ONLY)."""
        collector = await self.add_request(
            request_id,
            prompt,
            sampling_params,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        except EngineDeadError:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                logger.debug("Request %s cancelled by the caller: aborting", request_id)
                self._abort_nowait([request_id])
            raise
        finally:
            if finished:
                self.collectors.pop(request_id, None)
                self.core_ids.pop(request_id, None)

    async def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams | None,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> PoolingRequestOutput:
        """Embed one prompt with a pooling model (None: the model's default pooling)."""
        collector = await self.add_request(
            request_id,
            prompt,
            None,
            priority=priority,
            pooling_params=pooling_params,
            pooling=True,
            lora_request=lora_request,
        )
        finished = False
        try:
            output = await collector.get()
            finished = True
            return output
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self._abort_nowait([request_id])
            raise
        finally:
            self.collectors.pop(request_id, None)
            self.core_ids.pop(request_id, None)

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        pooling: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Process the prompt, register the request and send it to the core.

        `prompt` may be an EngineCoreRequest the caller built with `processor.process_inputs`
        (the server does, to answer 400 before streaming): it is taken as it is.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self.collectors:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._ensure_output_handler()
        if isinstance(prompt, EngineCoreRequest):
            request = prompt
        else:
            request = self.processor.process_inputs(
                request_id,
                prompt,
                params,
                time.time() if arrival_time is None else arrival_time,
                priority,
                cache_salt,
                pooling_params=pooling_params,
                pooling=pooling,
                lora_request=lora_request,
            )
        collector = RequestOutputCollector()
        self.collectors[request_id] = collector
        core_requests = _register(self.output_processor, request)
        self.core_ids[request_id] = [r.request_id for r in core_requests]
        now = time.monotonic()
        sent: list[str] = []
        try:
            for core_request in core_requests:
                self.stats_tracker.add(
                    core_request.request_id, now, len(core_request.prompt_token_ids)
                )
                await self.engine_core.add_request_async(core_request)
                sent.append(core_request.request_id)
        except BaseException:
            # Nothing of a request the core never got stays registered here.
            self.collectors.pop(request_id, None)
            self.core_ids.pop(request_id, None)
            for core_request in core_requests:
                self.stats_tracker.remove(core_request.request_id)
            self.output_processor.abort_requests([request_id])
            if (
                sent
                and self.dead_error is None
                and not getattr(self.engine_core, "engine_dead", False)
            ):
                try:
                    await self.engine_core.abort_requests_async(sent)
                except Exception:
                    logger.warning("Could not abort the parts of %s already sent", request_id)
            raise
        return collector

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends and its KV blocks are freed in the core."""
        core_ids = self._abort_local([request_id])
        await self.engine_core.abort_requests_async(core_ids)

    def _abort_local(self, request_ids: list[str]) -> list[str]:
        core_ids: list[str] = []
        for request_id in request_ids:
            ids = self.core_ids.pop(request_id, [request_id])
            core_ids.extend(ids)
            self.collectors.pop(request_id, None)
            for core_id in ids:
                self.stats_tracker.remove(core_id)
        aborted = self.output_processor.abort_requests(request_ids)
        for core_id in aborted or ():
            if core_id not in core_ids:
                core_ids.append(core_id)
        if request_ids:
            for stat_logger in self.stat_loggers:
                stat_logger.record_aborted(len(request_ids))
        return core_ids

    def _abort_nowait(self, request_ids: list[str]) -> None:
        """Abort from a synchronous context (cancelled generators): send in the background."""
        core_ids = self._abort_local(request_ids)
        if core_ids and self.dead_error is None:
            task = asyncio.get_running_loop().create_task(
                self.engine_core.abort_requests_async(core_ids)
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # ---- output handling --------------------------------------------------------------

    def start_output_handler(self) -> None:
        """Read the core's outputs from now on (else from the first request)."""
        self._ensure_output_handler()

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None or self._output_handler.done():
            loop = asyncio.get_running_loop()
            self._output_handler = loop.create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                await self._process_engine_outputs(outputs)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._propagate_error(e)
        except Exception as e:
            logger.exception("AsyncLLM output handler failed")
            self._propagate_error(EngineDeadError(f"output handler failed: {e}"))

    async def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        core_outputs = outputs.outputs
        timestamp = outputs.timestamp or time.time()
        iteration_stats = self.stats_tracker.update(core_outputs, time.monotonic())
        iteration_stats.queue_times = self.engine_core.pop_queue_times()
        for start in range(0, len(core_outputs), OUTPUT_CHUNK_SIZE):
            if start:
                await asyncio.sleep(0)
            chunk = core_outputs[start : start + OUTPUT_CHUNK_SIZE]
            processed = self.output_processor.process_outputs(chunk, timestamp)
            for request_output in processed.request_outputs:
                self._route(request_output)
            if processed.reqs_to_abort:  # stop strings matched: finished here, not in the core
                now = time.monotonic()
                for core_id in processed.reqs_to_abort:
                    finished = self.stats_tracker.finish(core_id, "stop", now)
                    if finished is not None:
                        iteration_stats.finished_requests.append(finished)
                await self.engine_core.abort_requests_async(list(processed.reqs_to_abort))
        if outputs.scheduler_stats is not None:
            self.last_scheduler_stats = outputs.scheduler_stats
        for stat_logger in self.stat_loggers:
            stat_logger.record(
                outputs.scheduler_stats, iteration_stats, engine_idx=outputs.engine_index
            )

    def _route(self, request_output: RequestOutput) -> None:
        collector = self.collectors.get(request_output.request_id)
        if collector is None:
            return  # aborted meanwhile
        collector.put(request_output)
        if request_output.finished:
            self.core_ids.pop(request_output.request_id, None)
            if isinstance(request_output, RequestOutput) and any(
                o.finish_reason == "error" for o in request_output.outputs
            ):
                logger.warning("Request %s failed in the engine", request_output.request_id)

    def _propagate_error(self, error: EngineDeadError) -> None:
        logger.error("Engine is dead: %s", error)
        self.dead_error = error
        for collector in self.collectors.values():
            collector.put(error)
        self.collectors.clear()

    # ---- health, tokenizer, lifecycle -------------------------------------------------

    @property
    def errored(self) -> bool:
        """Whether the engine has died."""
        if self.dead_error is None and self.engine_core.engine_dead:
            self.dead_error = EngineDeadError(self.engine_core.dead_message or "engine core died")
        return self.dead_error is not None

    @property
    def dead_engines(self) -> list[int]:
        """Data-parallel ranks whose engine died (the others still serve)."""
        return list(getattr(self.engine_core, "dead_engines", ()))

    @property
    def num_unfinished_requests(self) -> int:
        """Requests with an open stream."""
        return len(self.collectors)

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine process is dead."""
        if self.errored:
            raise self.dead_error  # type: ignore[misc]

    def get_tokenizer(self) -> Any:
        """The tokenizer of the served model."""
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        """The context length the engine serves."""
        return int(self.xlm_config.model_config.max_model_len)

    # ---- LoRA adapters (an engine with enable_lora) ---------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter in the engine; raises (RuntimeError naming the
        reason) when it is bad."""
        return await self.engine_core.call_utility_async("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.engine_core.call_utility_async("remove_lora", lora_id)

    async def list_loras(self) -> list[int]:
        return await self.engine_core.call_utility_async("list_loras")

    async def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache in the core."""
        return await self.engine_core.reset_prefix_cache_async()

    # ---- sleep mode and weight updates ---------------------------------------------------
    # No timeout: reading a large checkpoint again may take minutes.
    async def sleep(self, level: int = 1) -> dict[str, int]:
        """Free the weights' (level 1: to host memory) and KV cache's device memory."""
        freed = await self.engine_core.call_utility_async("sleep", level, timeout=None)
        self.sleeping = True
        return freed

    async def wake_up(self) -> None:
        await self.engine_core.call_utility_async("wake_up", timeout=None)
        self.sleeping = False

    async def is_sleeping(self) -> bool:
        self.sleeping = await self.engine_core.call_utility_async("is_sleeping")
        return self.sleeping

    async def update_weights(self, path: str) -> None:
        """Load new weights of the same shapes and dtypes from a checkpoint."""
        await self.engine_core.call_utility_async("update_weights", path, timeout=None)

    def do_log_stats(self) -> None:
        """Let each stat logger emit its periodic output."""
        for stat_logger in self.stat_loggers:
            stat_logger.log()

    async def abort_all(self) -> list[str]:
        """Abort every open request (shutdown); returns their ids."""
        request_ids = list(self.collectors)
        collectors = [self.collectors[r] for r in request_ids]
        if request_ids:
            core_ids = self._abort_local(request_ids)
            for collector in collectors:
                collector.put(RequestAbortedError("aborted: the server is shutting down"))
            if self.dead_error is None:
                await self.engine_core.abort_requests_async(core_ids)
        return request_ids

    def shutdown(self) -> None:
        """Stop the output handler and the engine process."""
        if self._output_handler is not None and not self._output_handler.done():
            self._output_handler.cancel()
        self.engine_core.shutdown()


def _load_tokenizer(xlm_config: Any) -> Any:
    """The model's tokenizer, as `Processor.from_config` gets it (cached by its source)."""
    model_config = xlm_config.model_config
    return get_tokenizer(model_config.model, model_config.tokenizer, model_config.trust_remote_code)


def _make_processor(xlm_config: Any, max_logprobs: int) -> Any:
    """The Processor of the configured model, with the server's logprobs limit."""
    processor = Processor.from_config(xlm_config)
    processor.max_logprobs = max_logprobs
    return processor


def _register(output_processor: Any, request: Any) -> list[Any]:
    """Track a request in the output processor; returns the requests to send to the core.

    n > 1 fans out into n child requests whose outputs the output processor merges back
    under the parent id.
    """
    return list(output_processor.add_engine_request(request))
