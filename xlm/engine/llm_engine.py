"""LLMEngine: processor -> engine core -> output processor, stepped by the caller."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from xlm.config import XlmConfig
from xlm.core.outputs import SchedulerStats
from xlm.engine.arg_utils import EngineArgs
from xlm.engine.core_client import EngineCoreClient, InprocClient
from xlm.engine.dp_client import DPSyncMPClient
from xlm.engine.exceptions import EngineBusyError, EngineDeadError
from xlm.engine.mp_client import SyncMPClient, start_engine_process
from xlm.engine.output_processor import OutputProcessor
from xlm.engine.processor import Processor
from xlm.logger import init_logger
from xlm.lora.request import LoRARequest
from xlm.metrics import startup
from xlm.outputs import RequestOutput
from xlm.plugins import load_general_plugins
from xlm.pooling_params import PoolingParams
from xlm.sampling_params import SamplingParams

logger = init_logger(__name__)


class LLMEngine:
    """The synchronous engine behind `xlm.LLM`."""

    def __init__(
        self,
        config: XlmConfig,
        multiprocess: bool = False,
        log_stats: bool = False,
        engine_process: Any = None,
    ) -> None:
        startup.begin()
        self.config = config
        # The tokenizer (importing transformers, ~1 s) loads on a thread while the engine
        # core is built: its weights and programs load mostly outside the GIL.
        with ThreadPoolExecutor(1, thread_name_prefix="xlm-tokenizer") as pool:
            processor = pool.submit(Processor.from_config, config)
            self.engine_core = self._make_core(config, multiprocess, log_stats, engine_process)
            try:
                with startup.phase("tokenizer"):
                    self.processor = processor.result()
            except BaseException:
                self.engine_core.shutdown()
                raise
        startup.note("tokenizer", "loaded beside the engine core: the wait after it")
        self.tokenizer = self.processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        startup.report("Engine")

    @staticmethod
    def _make_core(
        config: XlmConfig, multiprocess: bool, log_stats: bool, engine_process: Any
    ) -> EngineCoreClient:
        if config.parallel_config.data_parallel_size > 1:  # one process per rank
            with startup.phase("engine core processes"):
                return DPSyncMPClient(config, log_stats)
        if multiprocess:
            with startup.phase("engine core process"):
                if engine_process is not None:
                    engine_process.wait_until_ready()  # stopped if it failed to start
                return SyncMPClient(config, log_stats, engine=engine_process)
        return InprocClient(config, log_stats=log_stats)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess: bool = False) -> LLMEngine:
        """`multiprocess`: the engine core runs in its own process, spawned first thing
        (as `xlm serve`'s): it imports JAX and builds its config while this process builds
        the same, and loads the model while this one loads the tokenizer."""
        load_general_plugins()
        engine_process = None
        if multiprocess and engine_args.data_parallel_size == 1:
            engine_process = start_engine_process(engine_args, log_stats=False)
        try:
            config = engine_args.create_config()
        except BaseException:
            if engine_process is not None:
                engine_process.close()
            raise
        return cls(config, multiprocess=multiprocess, engine_process=engine_process)

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        pooling: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and tokenize a prompt, then hand it (or its n samples) to the core.

        With `pooling` the prompt is embedded by a pooling model (`params` unused).
        """
        request = self.processor.process_inputs(
            request_id,
            prompt,
            params,
            arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=pooling_params,
            pooling=pooling,
            lora_request=lora_request,
        )
        sent: list[str] = []
        try:
            for core_request in self.output_processor.add_engine_request(request):
                self.engine_core.add_request(core_request)
                sent.append(core_request.request_id)
        except BaseException:
            # The core refused it (or the send failed): forget it here too, so the caller's
            # loop over unfinished requests does not wait for it forever.
            self.output_processor.abort_requests([request_id])
            if sent:
                self.engine_core.abort_requests(sent)
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        core_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(core_ids)

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the outputs it produced."""
        outputs = self.engine_core.get_output()
        result = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        if result.reqs_to_abort:
            self.engine_core.abort_requests(result.reqs_to_abort)
        return result.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def encoder_cache_stats(self) -> dict[str, int]:
        """Images the encoder cache served (hits) and the encoder encoded (misses)."""
        return self.engine_core.get_encoder_cache_stats()

    @property
    def num_compilations(self) -> int:
        """Step programs the engine core compiled so far; flat after warm-up."""
        return self.engine_core.get_num_compilations()

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait until the background compilation has made every step program ready (then
        no step compiles); whether it has."""
        return self.engine_core.wait_for_programs(timeout)

    def get_stats(self) -> SchedulerStats:
        """The engine core's counters now: requests, KV cache, prefix cache, preemptions,
        speculative decoding (proposed, accepted, acceptance rate)."""
        return self.engine_core.get_stats()

    def get_stats_per_engine(self) -> list[SchedulerStats]:
        """Each data-parallel rank's counters, by rank (one entry without data parallelism)."""
        per_engine = getattr(self.engine_core, "get_stats_per_engine", None)
        return per_engine() if per_engine is not None else [self.get_stats()]

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    # ---- LoRA adapters (an engine with enable_lora) ---------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests; raises when it is bad."""
        return self.engine_core.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (its running requests finish with it); whether it was known."""
        return self.engine_core.call_utility("remove_lora", lora_id)

    def list_loras(self) -> list[int]:
        return self.engine_core.call_utility("list_loras")

    # ---- sleep mode and weight updates ---------------------------------------------------
    def sleep(self, level: int = 1) -> dict[str, int]:
        """Free the weights' (level 1: to host memory) and KV cache's device memory."""
        return self._admin("sleep", level)

    def wake_up(self) -> None:
        self._admin("wake_up")

    def is_sleeping(self) -> bool:
        return self._admin("is_sleeping")

    def update_weights(self, path: str) -> None:
        """Load new weights of the same shapes and dtypes from a checkpoint."""
        self._admin("update_weights", path)

    def device_bytes(self) -> dict[str, int]:
        """Bytes of weights and KV cache on the engine's devices now."""
        return self._admin("device_bytes")

    def _admin(self, method: str, *args: Any) -> Any:
        """Call the core without a timeout (reading a large checkpoint again takes
        minutes); a refusal from a core in another process raises as it would here."""
        try:
            return self.engine_core.call_utility(method, *args, timeout=None)
        except EngineDeadError:
            raise
        except RuntimeError as e:
            raise core_refusal(e) from None

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def core_refusal(error: RuntimeError) -> Exception:
    """The ValueError (or EngineBusyError) an engine-core process answered a utility call
    with, as its own class again; any other error as it is."""
    kind, sep, message = str(error).partition(": ")
    if sep and kind == "EngineBusyError":
        return EngineBusyError(message)
    if sep and kind == "ValueError":
        return ValueError(message)
    return error
