"""EngineArgs: every engine option in one dataclass, shared by LLM(...) and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

from xlm import envs, platforms
from xlm.config import (
    ASYNC_SCHEDULING_DEFAULT,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    STARTUP_PROGRAMS,
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
from xlm.logger import init_logger
from xlm.models.builtin import resolve_model_name
from xlm.models.pooling_config import (
    CONVERTS,
    default_pooling_params,
    resolve_convert,
    resolve_runner,
)

logger = init_logger(__name__)

_HELP = {
    "model": "model directory, .gguf file, built-in name (smollm2-135m) or Hugging Face "
    "name (org/name: the local hub cache first, downloaded unless HF_HUB_OFFLINE=1)",
    "revision": "branch, tag or commit of a Hugging Face model (default: main)",
    "download_dir": "Hugging Face cache directory to read and download into "
    "(default: HF_HUB_CACHE or HF_HOME/hub)",
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": "weights and activations dtype; auto = float32 on CPU, else the checkpoint's",
    "max_model_len": "context length (default: the model's)",
    "seed": "seed of the engine's random state",
    "load_format": "weights format: auto, safetensors, gguf or dummy (random weights); for a "
    "Hugging Face name only these files are fetched (auto: safetensors)",
    "quantization": "weight quantization: int8 (int8 weights per output channel), w8a8 (and "
    "int8 activations per token), fp8 (float8 e4m3 weights), int4 (4-bit weights packed two "
    "per byte, a scale and minimum per group of 128 inputs), quantized as loaded; or gguf "
    "(a GGUF file's own block quants kept: Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) "
    "(default: float weights, or a compressed-tensors checkpoint's own int8/w8a8/fp8)",
    "served_model_name": "model name in the API (default: the model argument)",
    "limit_mm_per_prompt": "most multimodal items per prompt, as JSON: '{\"image\": 4}' "
    "(default: 16 images)",
    "allowed_local_media_path": "directory under which file:// image URLs may be read "
    "(default: none; file:// URLs are refused)",
    "allowed_media_domains": "comma-separated hosts whose http(s) image URLs the server "
    "fetches (default: none; remote URLs are refused)",
    "max_image_pixels": "most pixels (width x height) of one input image (default: 64 Mpx)",
    "generation_config": "'auto' (use generation_config.json defaults), 'xlm' or a directory",
    "runner": "generate (text), pooling (embeddings: one vector per input), or auto (pooling "
    "when the checkpoint is an embedder: sentence-transformers files or a *Model "
    "architecture)",
    "convert": "what the pooling runner makes of the model: embed (vectors), classify (label "
    "scores from a score head: *ForSequenceClassification checkpoints, or a causal LM whose "
    "checkpoint has a score.weight; serves /classify, /score, /rerank), or auto (classify "
    "for *ForSequenceClassification, else embed); embed and classify imply --runner pooling",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "KV cache size in GiB on CPU (default: XLM_CPU_KVCACHE_SPACE or 1)",
    "memory_utilization": "fraction of accelerator memory xlm may use",
    "kv_offloading_size": "host KV tier in GiB of host memory per process: full blocks "
    "evicted from the device KV cache are kept there by block hash and copied back on a "
    "prefix hit instead of recomputed (0: off)",
    "kv_events_config": "publish prefix cache block events (BlockStored, BlockRemoved, "
    "AllBlocksCleared) for a router, a JSON object: enable_kv_cache_events, publisher (zmq), "
    "endpoint (tcp://...), topic",
    "kv_cache_dtype": "KV cache element type: auto (the model's dtype), float32, bfloat16, "
    "float16, fp8 (= fp8_e4m3), fp8_e5m2 or int8; fp8 halves bfloat16's cache bytes (more KV "
    "tokens in the same memory), values saturating at the type's largest; int8 stores each "
    "(token, KV head) row as int8 codes with one float32 scale (max|row| / 127), "
    "head_dim + 4 bytes",
    "enable_prefix_caching": "reuse cached KV blocks of shared prompt prefixes",
    "num_gpu_blocks_override": "fixed number of KV cache blocks (tests, benchmarks)",
    "max_num_batched_tokens": "token budget of one step",
    "max_num_seqs": "maximum number of requests in one step",
    "enable_chunked_prefill": "split long prompts across steps",
    "long_prefill_token_threshold": "chunk prefills longer than this (0: off)",
    "scheduling_policy": "fcfs or priority",
    "async_scheduling": "schedule step N+1 and process step N-1's outputs while step N "
    "runs; the sampled tokens feed the next step on the device",
    "tensor_parallel_size": "devices to shard the model over (env XLM_TENSOR_PARALLEL_SIZE)",
    "data_parallel_size": "engine cores behind one front end, each its own process on its "
    "own group of tensor_parallel_size devices; requests go to the least loaded rank or the "
    "one holding their prompt's first block in its prefix cache",
    "data_parallel_size_local": "data-parallel ranks on this host (default: all of them); "
    "fewer: the others run on other hosts (xlm serve --headless there)",
    "data_parallel_start_rank": "the first data-parallel rank this host runs (0 on the API "
    "server's host; --headless hosts: their first rank)",
    "data_parallel_address": "the API server host's address, where ranks on other hosts "
    "register (needed with --data-parallel-size-local below --data-parallel-size)",
    "data_parallel_rpc_port": "the port the API server listens on for ranks on other hosts "
    "(0 on the API server: any free port, logged)",
    "distributed_executor_backend": "uni (this process, all local devices) or multihost "
    "(jax.distributed, one process per host) (env XLM_DISTRIBUTED_EXECUTOR_BACKEND)",
    "coordinator_address": "multihost: host:port of process 0's jax.distributed coordinator "
    "(env XLM_COORDINATOR_ADDRESS, else the pod's: LWS_LEADER_ADDRESS, TPU_WORKER_HOSTNAMES)",
    "num_processes": "multihost: number of processes (env XLM_NUM_PROCESSES, else the pod's: "
    "LWS_GROUP_SIZE, TPU_WORKER_HOSTNAMES)",
    "process_id": "multihost: this process's id, 0 leads (env XLM_PROCESS_ID, else the pod's: "
    "LWS_WORKER_INDEX, TPU_WORKER_ID, JOB_COMPLETION_INDEX)",
    "custom_ops": "comma list: all, none, +name, -name",
    "token_buckets": "comma list of padded token counts per step",
    "startup_programs": "which step programs are ready before serving: all; largest (the "
    "largest token bucket's, the rest compiled in the background); first-use (the first "
    "step's, then the rest in the background); used (each when a step first needs it); "
    "None: largest for xlm serve and run-batch, first-use for LLM and xlm chat, used for "
    "xlm generate",
    "enable_compilation_cache": "save compiled step programs for the next start "
    "(XLM_COMPILATION_CACHE_DIR)",
    "reasoning_parser": "reasoning format (deepseek_r1, qwen3): splits reasoning_content "
    "out of chat replies; constraints apply after the reasoning",
    "target_topology": "compile for this TPU slice (v5e:2x2, v6e:2x4, v5p:2x2x1, v5e:4x4, ...) "
    "instead of running on the local devices; nothing is allocated or run",
    "structured_outputs_enable_in_reasoning": "apply structured-output constraints from the "
    "first token, reasoning included",
    "enable_lora": "serve LoRA adapters (PEFT directories) beside the base model: requests "
    "name one, each step mixes up to max_loras of them",
    "enable_sleep_mode": "allow sleep(level) / wake_up() (POST /sleep, /wake_up): level 1 "
    "moves the weights to host memory and drops the KV cache, level 2 drops both",
    "max_loras": "LoRA adapters on the device at once (slots; a step never mixes more)",
    "max_lora_rank": "largest adapter rank (every slot is padded to it)",
    "max_cpu_loras": "LoRA adapters kept read on the host (default: max_loras)",
    "speculative_config": "speculative decoding, a JSON object with method (ngram or "
    "draft_model), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max (ngram), "
    "model (draft_model: a smaller model with the same vocabulary), disable_by_batch_size "
    "and adaptive (false: always propose num_speculative_tokens); async scheduling is "
    "turned off with it",
}


# Options with no flag of their own in the engine CLIs: `xlm plan` adds target_topology's
# itself; the deprecated aliases of startup_programs get theirs from _add_deprecated_flags.
NO_FLAG = ("target_topology", "warmup", "compile_all_first")
# Deprecated option -> (the startup_programs it means when set, the value that sets it).
DEPRECATED_STARTUP_OPTIONS = {"compile_all_first": ("all", True), "warmup": ("used", False)}


_CHOICES = {
    "distributed_executor_backend": ("uni", "multihost"),
    "quantization": QUANTIZATION_METHODS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "startup_programs": STARTUP_PROGRAMS,
    "convert": CONVERTS,
}


def _add_deprecated_flags(group: Any, skip: tuple[str, ...]) -> None:
    """The old start-up flags, still accepted: EngineArgs maps them with a warning."""
    if "compile_all_first" not in skip:
        group.add_argument(
            "--compile-all-first",
            action="store_true",
            default=None,
            help="deprecated: --startup-programs all",
        )
    if "warmup" not in skip:
        group.add_argument(
            "--warmup",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="deprecated: --no-warmup is --startup-programs used",
        )


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
        group = parser.add_argument_group("engine")
        defaults = cls()
        for f in dataclasses.fields(cls):
            if f.name in skip or f.name in NO_FLAG:
                continue
            flag = "--" + f.name.replace("_", "-")
            flags = (flag, "-tp") if f.name == "tensor_parallel_size" else (flag,)
            default = getattr(defaults, f.name)
            help_text = f"{_HELP.get(f.name, '')} (default: {default})"
            if isinstance(default, bool):
                group.add_argument(
                    flag, default=default, help=help_text, action=argparse.BooleanOptionalAction
                )
            elif f.name == "limit_mm_per_prompt":
                group.add_argument(flag, default=default, help=help_text, type=json.loads)
            elif f.name in ("custom_ops", "allowed_media_domains"):
                group.add_argument(
                    flag,
                    default=default,
                    help=help_text,
                    type=lambda s: [x for x in s.split(",") if x],
                )
            elif f.name == "token_buckets":
                group.add_argument(
                    flag,
                    default=default,
                    help=help_text,
                    type=lambda s: [int(x) for x in s.split(",") if x],
                )
            else:
                kind = {int: int, float: float}.get(type(default), None)
                if f.name in (
                    "max_model_len",
                    "num_gpu_blocks_override",
                    "num_processes",
                    "max_cpu_loras",
                    "data_parallel_size_local",
                    "data_parallel_rpc_port",
                    "max_image_pixels",
                ):
                    kind = int
                elif f.name == "process_id":
                    kind = int
                elif f.name == "kv_cache_memory":
                    kind = float
                choices = _CHOICES.get(f.name)
                group.add_argument(
                    *flags, default=default, help=help_text, type=kind or str, choices=choices
                )

        _add_deprecated_flags(group, skip)

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
