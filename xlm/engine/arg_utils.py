"""EngineArgs: every engine option in one dataclass, shared by LLM(...) and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from xlm import envs, platforms
from xlm.config import (
    ASYNC_SCHEDULING_DEFAULT,
    CacheConfig,
    CompilationConfig,
    KVEventsConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    XlmConfig,
)
from xlm.config.checks import parse_json_text
from xlm.engine.arg_flags import add_engine_flags
from xlm.logger import init_logger
from xlm.models.builtin import resolve_model_name
from xlm.models.pooling_config import (
    default_pooling_params,
    resolve_convert,
    resolve_runner,
)
from xlm.multimodal.processor_config import resolve_processor_config

logger = init_logger(__name__)

# Deprecated option -> (the startup_programs it means when set, the value that sets it).
DEPRECATED_STARTUP_OPTIONS = {"compile_all_first": ("all", True), "warmup": ("used", False)}


def _gguf_quant_layout(model_path: str, load_format: str) -> Any:
    """The grouped layout of a GGUF's own quants (quantization="gguf" needs a GGUF)."""
    from xlm.models.loader import resolve_load_format
    from xlm.models.loader.gguf import gguf_quant_layout

    if resolve_load_format(model_path, load_format) != "gguf":
        raise ValueError(
            f"quantization='gguf' keeps a GGUF file's own quants; {model_path!r} is not a "
            "GGUF checkpoint (use int8, w8a8, fp8 or int4 to quantize other checkpoints)"
        )
    return gguf_quant_layout(model_path)


@dataclass
class EngineArgs:
    """Engine options with defaults; `create_config()` turns them into an XlmConfig."""

    model: str = "smollm2-135m"
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"
    quantization: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    served_model_name: str | None = None
    generation_config: str = "auto"
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    max_image_pixels: int | None = None
    # A dict (or its JSON text) of the image processor's options (vLLM's name).
    mm_processor_kwargs: dict[str, Any] | str | None = None
    runner: str = "auto"
    convert: str = "auto"
    block_size: int = CacheConfig.block_size
    kv_cache_memory: float | None = None
    memory_utilization: float = CacheConfig.memory_utilization
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    kv_offloading_size: float = 0.0
    # A dict (or its JSON text) of KVEventsConfig's fields; None: no events.
    kv_events_config: dict[str, Any] | str | None = None
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    async_scheduling: bool = ASYNC_SCHEDULING_DEFAULT
    tensor_parallel_size: int = field(default_factory=lambda: envs.XLM_TENSOR_PARALLEL_SIZE or 1)
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    distributed_executor_backend: str = field(
        default_factory=lambda: envs.XLM_DISTRIBUTED_EXECUTOR_BACKEND or "uni"
    )
    coordinator_address: str | None = field(default_factory=lambda: envs.XLM_COORDINATOR_ADDRESS)
    num_processes: int | None = field(default_factory=lambda: envs.XLM_NUM_PROCESSES)
    process_id: int | None = field(default_factory=lambda: envs.XLM_PROCESS_ID)
    custom_ops: list[str] = field(default_factory=list)
    token_buckets: list[int] | None = None
    # None: the entry point's (LLM: "first-use"; serving: CompilationConfig's "largest").
    startup_programs: str | None = None
    # Deprecated aliases of startup_programs: compile_all_first=True is "all", warmup=False
    # is "used" (each program compiled when a step first needs it).
    warmup: bool | None = None
    compile_all_first: bool | None = None
    enable_compilation_cache: bool = True
    reasoning_parser: str | None = None
    structured_outputs_enable_in_reasoning: bool = False
    # A dict (or its JSON text) of SpeculativeConfig's fields; None: no speculation.
    speculative_config: dict[str, Any] | str | None = None
    # LoRA adapters (LoRAConfig): off unless enable_lora.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Sleep mode: LLM.sleep / wake_up and the server's POST /sleep, /wake_up.
    enable_sleep_mode: bool = False
    # Compile-only (`xlm plan` adds the flag; an engine refuses it).
    target_topology: str | None = None

    def __post_init__(self) -> None:
        for name, (mode, value) in DEPRECATED_STARTUP_OPTIONS.items():
            given = getattr(self, name)
            if given is None:
                continue
            if given == value:
                message = f"{name}={given} is deprecated: use startup_programs={mode!r}"
            else:
                message = f"{name}={given} is deprecated and does nothing: use startup_programs"
            warnings.warn(message, DeprecationWarning, stacklevel=3)
            logger.warning(message)
            if given == value and self.startup_programs is None:
                self.startup_programs = mode
            setattr(self, name, None)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one --flag per field (booleans get --x/--no-x)."""
        add_engine_flags(parser.add_argument_group("engine"), cls(), skip)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def create_parallel_config(self) -> ParallelConfig:
        """The ParallelConfig alone (followers of a multihost engine need only this).

        Under multihost, what the options and XLM_* leave unset comes from the pod's own
        environment (a TPU VM, a Kubernetes Indexed Job or LeaderWorkerSet), so the same
        command runs on every host."""
        coordinator, count, process_id = (
            self.coordinator_address,
            self.num_processes,
            self.process_id,
        )
        if self.distributed_executor_backend == "multihost":
            pod = envs.pod_environment()
            coordinator = coordinator or pod.coordinator_address
            count = count if count is not None else pod.num_processes
            process_id = process_id if process_id is not None else pod.process_id
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            data_parallel_size_local=self.data_parallel_size_local,
            data_parallel_start_rank=self.data_parallel_start_rank,
            data_parallel_address=self.data_parallel_address,
            data_parallel_rpc_port=self.data_parallel_rpc_port,
            executor_backend=self.distributed_executor_backend,
            coordinator_address=coordinator,
            num_processes=count,
            process_id=process_id,
            target_topology=self.target_topology,
        )

    def _model_config(
        self, model: str, tokenizer: str | None, runner: str, convert: str = "none"
    ) -> ModelConfig:
        """A model's config: its path or name resolved, its HF config read, its runner."""
        from xlm.models.loader import load_hf_config
        from xlm.models.loader.compressed_tensors import (
            quantization_config,
            resolve_quantization,
        )
        from xlm.quantization import PER_CHANNEL

        hub = dict(revision=self.revision, download_dir=self.download_dir)
        model_path = resolve_model_name(model, load_format=self.load_format, **hub)
        model_config = ModelConfig(
            model=model_path,
            tokenizer=tokenizer,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            load_format=self.load_format,
            quantization=self.quantization,
            served_model_name=self.served_model_name or model,
            generation_config=self.generation_config,
            limit_mm_per_prompt=self.limit_mm_per_prompt,
            allowed_local_media_path=self.allowed_local_media_path,
            allowed_media_domains=self.allowed_media_domains,
            max_image_pixels=self.max_image_pixels,
            mm_processor_kwargs=parse_json_text("mm_processor_kwargs", self.mm_processor_kwargs),
        )
        model_config.hf_config = load_hf_config(model_path, self.load_format)
        # A compressed-tensors checkpoint runs in the scheme it is stored in.
        model_config.quantization = resolve_quantization(self.quantization, model_config.hf_config)
        if self.quantization == "gguf":
            model_config.quant_layout = _gguf_quant_layout(model_path, self.load_format)
        elif quantization_config(model_config.hf_config) is not None:
            model_config.quant_layout = PER_CHANNEL  # the checkpoint's scales, as stored
        architectures = getattr(model_config.hf_config, "architectures", None)
        model_config.runner = resolve_runner(runner, model_path, architectures, convert)
        model_config.convert = resolve_convert(convert, model_config.runner, architectures)
        return model_config

    def _draft_model_config(self, draft: str, target: ModelConfig) -> ModelConfig:
        """The draft model's config (speculative_config.model): read like the target's,
        and refused unless its vocabulary is the target's (its proposals are token ids)."""
        config = self._model_config(draft, target.tokenizer or target.model, "generate")
        have = config.hf_config.vocab_size
        want = target.hf_config.vocab_size
        if have != want:
            raise ValueError(
                f"speculative_config.model={draft!r} is invalid: its vocab_size {have} is not "
                f"the target model's {want} (a draft must share the target's tokenizer)"
            )
        return config

    def create_config(self) -> XlmConfig:
        """Validate, resolve the model, read its config and apply platform defaults."""
        tokenizer = self.tokenizer
        if tokenizer is not None:
            hub = dict(revision=self.revision, download_dir=self.download_dir)
            tokenizer = resolve_model_name(tokenizer, load_format="dummy", **hub)
        model_config = self._model_config(self.model, tokenizer, self.runner, self.convert)
        model_config.enable_sleep_mode = self.enable_sleep_mode
        if model_config.is_pooling:
            model_config.default_pooling = default_pooling_params(
                model_config.model, model_config.convert
            )
        speculative = self._speculative_config(model_config)
        max_model_len = self._max_model_len(model_config, speculative)
        config = XlmConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=self.kv_cache_memory,
                memory_utilization=self.memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                num_blocks=self.num_gpu_blocks_override,
                cache_dtype=self.kv_cache_dtype,
                kv_offloading_size=self.kv_offloading_size,
            ),
            scheduler_config=self._scheduler_config(
                max_model_len, self._async_scheduling(model_config, speculative)
            ),
            parallel_config=self.create_parallel_config(),
            compilation_config=CompilationConfig(
                custom_ops=list(self.custom_ops),
                token_buckets=self.token_buckets,
                startup_programs=self.startup_programs or CompilationConfig.startup_programs,
                enable_compilation_cache=self.enable_compilation_cache,
            ),
            structured_outputs_config=StructuredOutputsConfig(
                reasoning_parser=self.reasoning_parser,
                enable_in_reasoning=self.structured_outputs_enable_in_reasoning,
            ),
            speculative_config=speculative,
            lora_config=LoRAConfig(
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                max_cpu_loras=self.max_cpu_loras,
            )
            if self.enable_lora
            else None,
            kv_events_config=KVEventsConfig.from_dict(self.kv_events_config),
        )
        draft = speculative.draft_model_config if speculative is not None else None
        if draft is not None and config.parallel_config.is_multihost:
            # Each process would time its own steps and pick its own k: the draft's
            # collectives would diverge across processes.
            raise ValueError(
                "speculative_config method 'draft_model' is invalid with "
                "distributed_executor_backend='multihost': use 'ngram', or one process"
            )
        config.set_max_model_len(max_model_len)
        platforms.current_platform.check_and_update_config(config)
        # The image processor's config with mm_processor_kwargs and the engine's cap, now
        # that the step budget is known (a bad key or value fails here, at construction).
        resolve_processor_config(config)
        return config

    def _speculative_config(self, model_config: ModelConfig) -> SpeculativeConfig | None:
        """speculative_config parsed, with its draft model's config read."""
        speculative = SpeculativeConfig.from_dict(self.speculative_config)
        if speculative is None:
            return None
        if model_config.is_pooling:
            raise ValueError(
                "speculative_config is invalid with the pooling runner: nothing is decoded"
            )
        if speculative.method == "draft_model":
            speculative.draft_model_config = self._draft_model_config(
                speculative.model, model_config
            )
        return speculative

    def _async_scheduling(
        self, model_config: ModelConfig, speculative: SpeculativeConfig | None
    ) -> bool:
        """async_scheduling, turned off where the next step cannot be scheduled early."""
        if not self.async_scheduling:
            return False
        if model_config.is_pooling:
            # A pooled request finishes in its one prefill step: nothing to overlap.
            logger.info("Pooling runner: async scheduling off (prefill-only steps).")
            return False
        if speculative is not None:
            # The next step's tokens depend on how many proposals this one accepts.
            logger.info("Speculative decoding: async scheduling off.")
            return False
        return True

    def _max_model_len(
        self, model_config: ModelConfig, speculative: SpeculativeConfig | None
    ) -> int:
        """The context length: max_model_len, within the model's (and the draft's)."""
        model_max = _model_max_len(model_config.hf_config)
        max_model_len = self.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's "
                f"maximum context length {model_max}"
            )
        draft = speculative.draft_model_config if speculative is not None else None
        if draft is not None:
            draft_max = _model_max_len(draft.hf_config)
            if draft_max < max_model_len:
                raise ValueError(
                    f"speculative_config.model={speculative.model!r} is invalid: its maximum "
                    f"context length {draft_max} is below max_model_len={max_model_len}"
                )
            draft.max_model_len = max_model_len
        return max_model_len

    def _scheduler_config(self, max_model_len: int, async_scheduling: bool) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=SchedulerConfig.step_budget(
                self.max_num_batched_tokens, max_model_len, self.enable_chunked_prefill
            ),
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
            async_scheduling=async_scheduling,
        )


def _model_max_len(hf_config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048
