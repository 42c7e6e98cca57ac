"""EngineCore: the scheduler and the executor joined by one step loop."""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

from xlm.config import XlmConfig
from xlm.core.async_scheduler import AsyncScheduler
from xlm.core.outputs import SchedulerOutput, SchedulerStats
from xlm.core.request import Request, RequestStatus
from xlm.core.scheduler import Scheduler
from xlm.core.step_plan import ImageRule
from xlm.engine.exceptions import EngineBusyError
from xlm.engine.kv_events_publisher import make_kv_event_publisher
from xlm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from xlm.executor import executor_class_for
from xlm.executor.abstract import Executor
from xlm.logger import init_logger
from xlm.lora.request import LoRARequest
from xlm.metrics import startup
from xlm.multimodal.budget import encoder_cache_slots, images_in_one_step
from xlm.multimodal.processor_config import resolve_processor_config
from xlm.structured_output.manager import StructuredOutputManager
from xlm.tokenizer import get_eos_token_ids, get_tokenizer

logger = init_logger(__name__)


class EngineCore:
    """Schedules, executes and updates; device work happens in the executor.

    Its public methods are what an engine-core client may call: in this process through
    `InprocClient`, or in the engine process (`EngineCoreProc`) through UTILITY messages.
    """

    def __init__(
        self,
        config: XlmConfig,
        log_stats: bool = True,
        executor_class: type[Executor] | None = None,
    ) -> None:
        start = time.perf_counter()
        self.config = config
        self.log_stats = log_stats
        # None: the class ParallelConfig.executor_backend names (uni or multihost).
        self.executor = (executor_class or executor_class_for(config))(config)
        self.structured_output_manager = make_structured_output_manager(config)
        async_scheduling = config.scheduler_config.async_scheduling
        self.scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
            config.scheduler_config,
            config.cache_config,
            self.executor.num_blocks,
            self.structured_output_manager,
            max_loras=None if config.lora_config is None else config.lora_config.max_loras,
            kv_events=config.kv_events_config is not None and config.kv_events_config.publishes,
        )
        self.kv_event_publisher = make_kv_event_publisher(
            config.kv_events_config, config.parallel_config.data_parallel_rank
        )
        # Long-lived objects (the block pool: ~65k blocks at 1024 requests) leave the GC's
        # view, so full collections stop rescanning them mid-serving (p99 4x lower).
        gc.collect()
        gc.freeze()
        self._first_step = True  # its time is logged: it is the first request's latency
        # Async scheduling: steps dispatched and not yet collected, oldest first (at most
        # two: step N runs while step N+1 is scheduled and dispatched behind it).
        self.async_scheduling = config.scheduler_config.async_scheduling
        slots = encoder_cache_slots(
            config.model_config.hf_config,
            config.scheduler_config.max_num_batched_tokens,
            resolve_processor_config(config),
        )
        if slots:  # a step covers no more images than the runner's encoder cache holds
            self.scheduler.image_rule = ImageRule(slots, images_in_one_step(config))
        self._in_flight: deque[SchedulerOutput] = deque()
        self._first_dispatch: float | None = None
        self._sleep_level: int | None = None  # asleep: the level (sleep mode)
        logger.info("Engine core ready in %.1f s.", time.perf_counter() - start)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit a request; raises ValueError when it can never fit (or its LoRA adapter
        cannot be read: LoRAAdapterError)."""
        if self._sleep_level is not None:
            raise ValueError("the engine is asleep: call wake_up() before adding requests")
        lora = request.lora_request
        if lora is not None and self.config.lora_config is not None:
            self.executor.add_lora(lora)  # read and checked now, not mid-step
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
                priority=request.priority,
                cache_salt=request.cache_salt,
                pooling_params=request.pooling_params,
                lora_request=lora,
                mm_features=request.mm_features,
            )
        )

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests (LoRAAdapterError when bad)."""
        self._require_lora()
        return self.executor.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; requests using it finish with it first."""
        self._require_lora()
        return self.executor.remove_lora(lora_id)

    def list_loras(self) -> list[int]:
        self._require_lora()
        return self.executor.list_loras()

    def _require_lora(self) -> None:
        if self.config.lora_config is None:
            raise ValueError("LoRA adapters are off: start the engine with enable_lora=True")

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule one step, run it, and return the new tokens and finished requests.

        With async scheduling the step scheduled now is dispatched, and the outputs
        returned are those of the step before it (its tokens were sampled while this one
        was scheduled); a call may return no outputs while the first step runs.
        """
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self._stats(), timestamp=time.time())
        scheduler_output = self._schedule()
        if self._first_step:
            self._first_step = False
            start = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output)
            self._log_first_step(scheduler_output, start)
        else:
            runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs, self._stats(), time.time())

    def _step_async(self) -> EngineCoreOutputs:
        in_flight = self._in_flight
        dispatched = False
        if self.scheduler.has_unfinished_requests() and len(in_flight) < 2:
            # Requests whose token is in flight are scheduled with a placeholder for it.
            scheduler_output = self._schedule(idle_ok=bool(in_flight))
            if self._first_dispatch is None and scheduler_output.total_num_scheduled_tokens:
                self._first_dispatch = time.perf_counter()
            self.executor.dispatch(scheduler_output)
            in_flight.append(scheduler_output)
            dispatched = scheduler_output.total_num_scheduled_tokens > 0
        # Wait for the older step when the device has the next one queued behind it (or
        # nothing new could be scheduled).
        if not in_flight or (dispatched and len(in_flight) < 2):
            return EngineCoreOutputs(scheduler_stats=self._stats(), timestamp=time.time())
        scheduler_output = in_flight.popleft()
        runner_output = self.executor.collect()
        if self._first_step and scheduler_output.total_num_scheduled_tokens:
            self._first_step = False
            self._log_first_step(scheduler_output, self._first_dispatch)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs, self._stats(), time.time())

    def _schedule(self, idle_ok: bool = False) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.scheduler.take_kv_events())
        if (
            not scheduler_output.num_scheduled_tokens
            and not idle_ok
            and self.structured_output_manager.has_pending
        ):
            # Everything runnable waits for a grammar: idle until one compiles, not spin.
            self.structured_output_manager.wait_for_any(timeout=0.05)
        return scheduler_output

    @staticmethod
    def _log_first_step(scheduler_output: SchedulerOutput, start: float) -> None:
        logger.info(
            "First step (%d tokens): %.0f ms.",
            scheduler_output.total_num_scheduled_tokens,
            1e3 * (time.perf_counter() - start),
        )
        startup.run_deferred()  # what the start left for after the first token

    def _stats(self) -> SchedulerStats | None:
        return self.make_stats() if self.log_stats else None

    def make_stats(self) -> SchedulerStats:
        """The scheduler's counters now (running, waiting, KV cache usage, prefix hits)
        and how many step programs are ready."""
        stats = self.scheduler.make_stats()
        stats.programs_ready, stats.programs_total = self.programs_ready()
        return stats

    def programs_ready(self) -> tuple[int, int]:
        """(ready, registered) step programs: the rest compile in the background."""
        return self.executor.programs_ready()

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or a step in flight whose outputs are owed."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def is_request_waiting(self, request_id: str) -> bool:
        """Whether the request is admitted and waits for its first (or next) schedule."""
        return self.scheduler.is_waiting(request_id)

    def get_ready_info(self) -> dict[str, Any]:
        """What a client learns once the core is up: the context length and KV blocks."""
        return {
            "max_model_len": self.config.model_config.max_model_len,
            "num_blocks": self.config.cache_config.num_blocks,
            # The longest prompt the KV cache admits (with KV cache groups, all groups'
            # blocks together must fit, so it is less than (num_blocks - 1) * block_size).
            "kv_cache_tokens": self.scheduler.kv_cache_manager.max_request_tokens,
            # The devices this process sees (a data-parallel rank: only its own group).
            "num_local_devices": _num_local_devices(),
            "data_parallel_rank": self.config.parallel_config.data_parallel_rank,
        }

    def reset_prefix_cache(self) -> bool:
        done = self.scheduler.reset_prefix_cache()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.scheduler.take_kv_events())
        return done

    def get_num_compilations(self) -> int:
        """Step programs compiled or loaded so far (flat once all are ready)."""
        return self.executor.get_num_compilations()

    # ---- sleep mode and weight updates ---------------------------------------------------
    def sleep(self, level: int = 1) -> dict[str, int]:
        """Free the device memory of the weights (level 1: moved to host memory; level 2:
        dropped, read again from the checkpoint on wake_up) and of the KV cache; the bytes
        freed. Asleep already: nothing happens. The engine must be idle."""
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError(
                "sleep mode is off: start the engine with enable_sleep_mode=True "
                "(--enable-sleep-mode)"
            )
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(
                f"level={level!r} is invalid: 1 (weights to host memory, KV cache dropped) "
                "or 2 (weights and KV cache dropped)"
            )
        if self._sleep_level is not None:
            return {"weights": 0, "kv_cache": 0}
        self._require_idle("sleep")
        # No program may be lowered from the weights while they are gone.
        self.executor.wait_for_programs()
        self.scheduler.reset_prefix_cache()  # the cached blocks' K/V go with the cache
        freed = self.executor.sleep(level)
        self._sleep_level = level
        return freed

    def wake_up(self) -> None:
        """Bring the weights and an empty KV cache back; awake already: nothing happens."""
        if self._sleep_level is None:
            return
        self.executor.wake_up()
        self._sleep_level = None

    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    def update_weights(self, path: str) -> None:
        """Load new weights from a checkpoint of the same architecture (shapes and dtypes
        checked: ValueError naming the tensor, nothing changed); the prefix cache, computed
        with the old weights, is dropped. The engine must be awake and idle."""
        if self._sleep_level is not None:
            raise ValueError("update_weights: the engine is asleep; call wake_up() first")
        self._require_idle("update_weights")
        self.executor.update_weights(path)
        self.scheduler.reset_prefix_cache()

    def device_bytes(self) -> dict[str, int]:
        """Bytes of weights and KV cache on this process's devices now."""
        return self.executor.device_bytes()

    def _require_idle(self, what: str) -> None:
        # Async scheduling may leave a step in flight after its requests finished: collect
        # it (its outputs concern no one any more).
        while self._in_flight and not self.scheduler.has_unfinished_requests():
            self.step()
        if self.has_unfinished_requests():
            raise EngineBusyError(
                f"{what}: {self.scheduler.get_num_unfinished_requests()} requests are "
                "unfinished; call it when the engine is idle (wait for or abort them)"
            )

    def get_encoder_cache_stats(self) -> dict[str, int]:
        """Images found in the encoder cache (hits) and encoded (misses) so far."""
        return self.executor.worker.model_runner.encoder_cache_stats()

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation; whether every step program is ready."""
        return self.executor.wait_for_programs(timeout)

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()


def make_structured_output_manager(config: XlmConfig) -> StructuredOutputManager:
    """The core's structured-output manager (loads the tokenizer on the first constraint)."""
    model = config.model_config

    def tokenizer_factory() -> Any:
        return get_tokenizer(model.model, model.tokenizer, model.trust_remote_code)

    so_config = config.structured_outputs_config
    return StructuredOutputManager(
        tokenizer_factory,
        model.hf_config.vocab_size,
        eos_token_ids=sorted(get_eos_token_ids(None, model.hf_config)),
        reasoning_parser=so_config.reasoning_parser,
        enable_in_reasoning=so_config.enable_in_reasoning,
    )


def _num_local_devices() -> int:
    import jax

    return jax.local_device_count()
