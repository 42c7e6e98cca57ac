"""Typed configuration: one XlmConfig made of its parts, validated on construction."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from xlm.config.checks import _positive_int, _require
from xlm.config.compilation import STARTUP_PROGRAMS as STARTUP_PROGRAMS
from xlm.config.compilation import CompilationConfig
from xlm.config.kv_events import KVEventsConfig
from xlm.config.parallel import ParallelConfig
from xlm.config.speculative import SPECULATIVE_METHODS as SPECULATIVE_METHODS
from xlm.config.speculative import SpeculativeConfig

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# --kv-cache-dtype: a dtype name, fp8 (float8 e4m3fn, as "fp8_e4m3") / fp8_e5m2, or int8
# (codes with one float32 scale per (token, kv head) row: ragged_paged_attention.kv_quant).
KV_CACHE_DTYPES = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8",
)
_KV_NUMPY_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_cache_dtype_name(cache_dtype: str) -> str:
    """The numpy/jax name of a non-"auto" --kv-cache-dtype value."""
    return _KV_NUMPY_NAMES.get(cache_dtype, cache_dtype)


# xlm.quantization.SCHEMES (named here so that config imports nothing heavy).
QUANTIZATION_METHODS = ("int8", "w8a8", "fp8", "gguf", "int4")


@dataclass
class ModelConfig:
    """What model to run and how to load it."""

    model: str
    tokenizer: str | None = None
    dtype: DTypeName = "auto"
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"
    served_model_name: str | None = None
    trust_remote_code: bool = False
    # "auto": use the model's generation_config.json defaults; "xlm": ignore them;
    # any other value is a directory holding a generation_config.json.
    generation_config: str = "auto"
    # "generate" (a language model) or "pooling" (an embedder: one vector per prompt).
    runner: str = "generate"
    # What a pooling runner's model is converted to: "embed" (its hidden states) or
    # "classify" (a score head over them, xlm.models.classifier); "none" when generating.
    convert: str = "none"
    # Weight quantization (xlm.quantization): None (as the checkpoint's dtype), "int8",
    # "w8a8", "fp8", "int4" (packed 4-bit, grouped), or "gguf" (a GGUF's own block quants,
    # kept).
    quantization: str | None = None
    # Set with quantization="gguf" from the file: the scales' group size along the input
    # and whether groups have a minimum (xlm.quantization.QuantLayout).
    quant_layout: Any = None
    # Set by the loader: the element type float projection kernels and embedding tables
    # are stored in when it differs from the activations' (--dtype float16/bfloat16 on
    # CPU: half weights, float32 activations); None: the model's dtype.
    weight_dtype: Any = field(default=None, repr=False, compare=False)
    # Sleep mode (LLM.sleep / wake_up, POST /sleep): the weights can leave the devices.
    enable_sleep_mode: bool = False
    # Set by the loader once the checkpoint's config has been read.
    # Images in (a multimodal model): at most this many items per prompt by modality
    # ({"image": 4}); where images may be read from; the pixel cap of one image.
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    max_image_pixels: int | None = None
    # Options of the model's image processor over its preprocessor_config.json (vLLM's
    # mm_processor_kwargs: Qwen2-VL's {"min_pixels": ..., "max_pixels": ...}); the keys a
    # family takes are checked once the checkpoint's config is read.
    mm_processor_kwargs: dict[str, Any] | None = None
    # Set with the scheduler's budget (xlm.multimodal.processor_config): the preprocessor
    # config the engine runs with, the kwargs applied and Qwen2-VL's max_pixels fit.
    mm_processor_config: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    hf_config: Any = field(default=None, repr=False, compare=False)
    # The pooling a pooling runner applies when a request does not say (set with runner).
    default_pooling: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        owner = "ModelConfig"
        _require(
            isinstance(self.model, str) and self.model != "",
            owner,
            "model",
            self.model,
            "a non-empty path or model name",
        )
        _require(self.dtype in _DTYPES, owner, "dtype", self.dtype, f"one of {_DTYPES}")
        _require(
            self.load_format in _LOAD_FORMATS,
            owner,
            "load_format",
            self.load_format,
            f"one of {_LOAD_FORMATS}",
        )
        _positive_int(owner, "max_model_len", self.max_model_len, optional=True)
        _positive_int(owner, "max_image_pixels", self.max_image_pixels, optional=True)
        limits = self.limit_mm_per_prompt
        _require(
            limits is None
            or (
                isinstance(limits, dict)
                and set(limits) <= {"image"}
                and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0
                    for v in limits.values()
                )
            ),
            owner,
            "limit_mm_per_prompt",
            limits,
            'a dict like {"image": N} with N >= 0',
        )
        kwargs = self.mm_processor_kwargs
        _require(
            kwargs is None
            or (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)),
            owner,
            "mm_processor_kwargs",
            kwargs,
            'a JSON object of the image processor\'s options, like {"max_pixels": 1003520}',
        )
        _require(
            self.quantization is None or self.quantization in QUANTIZATION_METHODS,
            owner,
            "quantization",
            self.quantization,
            f"None or one of {QUANTIZATION_METHODS}",
        )
        _require(
            self.runner in ("generate", "pooling"),
            owner,
            "runner",
            self.runner,
            "'generate' or 'pooling'",
        )
        _require(
            self.convert in ("none", "embed", "classify"),
            owner,
            "convert",
            self.convert,
            "'none', 'embed' or 'classify'",
        )
        _require(
            isinstance(self.seed, int) and self.seed >= 0,
            owner,
            "seed",
            self.seed,
            "an integer >= 0",
        )

    @property
    def is_pooling(self) -> bool:
        """Whether the model runs as a pooler (embeddings) rather than a generator."""
        return self.runner == "pooling"

    @property
    def is_classifier(self) -> bool:
        """Whether the pooling model scores labels (--convert classify) instead of embedding."""
        return self.is_pooling and self.convert == "classify"

    @property
    def name(self) -> str:
        """The name clients use for this model (served name, else the model argument)."""
        return self.served_model_name or self.model


@dataclass
class CacheConfig:
    """The paged KV cache: block size, how much memory, prefix caching."""

    block_size: int = 16
    # CPU: KV cache size in GiB (None: XLM_CPU_KVCACHE_SPACE, else 1 GiB).
    kv_cache_memory: float | None = None
    # GPU/TPU: fraction of device memory xlm may use in total.
    memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # Set after memory profiling; a value here overrides profiling (tests, benchmarks).
    num_blocks: int | None = None
    # Set by the worker from the model: the attention window every layer shares (None:
    # some layer attends to the whole context); the KV manager frees blocks outside it.
    sliding_window: int | None = None
    # Set by the worker from the model when its layers use several windows: one KV cache
    # group (xlm.core.kv_cache_groups.KVCacheGroupSpec) per window, each its own block table.
    kv_cache_groups: list[Any] | None = None
    # Host KV tier (vLLM's kv_offloading_size): GiB of host memory per process that keeps
    # full blocks evicted from the device pool (xlm.core.host_kv_tier); 0: off.
    kv_offloading_size: float = 0.0
    # Set by the worker: the host tier's slots (blocks) and bytes per block (per process).
    num_host_blocks: int = 0
    host_block_bytes: int = 0

    def __post_init__(self) -> None:
        owner = "CacheConfig"
        _require(
            isinstance(self.kv_offloading_size, (int, float)) and self.kv_offloading_size >= 0,
            owner,
            "kv_offloading_size",
            self.kv_offloading_size,
            "a number of GiB >= 0 (0: no host KV tier)",
        )
        _positive_int(owner, "block_size", self.block_size)
        _require(
            self.block_size & (self.block_size - 1) == 0,
            owner,
            "block_size",
            self.block_size,
            "a power of two",
        )
        if self.kv_cache_memory is not None:
            _require(
                self.kv_cache_memory > 0,
                owner,
                "kv_cache_memory",
                self.kv_cache_memory,
                "a positive number of GiB or None",
            )
        _require(
            0.0 < self.memory_utilization <= 1.0,
            owner,
            "memory_utilization",
            self.memory_utilization,
            "a fraction in (0, 1]",
        )
        _require(
            self.cache_dtype in KV_CACHE_DTYPES,
            owner,
            "cache_dtype",
            self.cache_dtype,
            f"one of {KV_CACHE_DTYPES}",
        )
        if self.num_blocks is not None:
            _require(
                isinstance(self.num_blocks, int) and self.num_blocks >= 2,
                owner,
                "num_blocks",
                self.num_blocks,
                "an integer >= 2 (block 0 is the null block)",
            )


# Whether async scheduling is on unless asked otherwise (RESULTS.md has the measurement).
ASYNC_SCHEDULING_DEFAULT = True


@dataclass
class SchedulerConfig:
    """How the scheduler spends each step: token budget, request cap, chunking, policy."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # Copied from ModelConfig by XlmConfig once the model length is known.
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # A prefill longer than this is chunked to it even when budget remains (0: off).
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    # Step N+1 is scheduled and dispatched before step N's tokens reach the host
    # (xlm.engine.core); requests that need their last token on the host to be scheduled
    # (grammars, penalties, bans) wait for it.
    async_scheduling: bool = ASYNC_SCHEDULING_DEFAULT

    @staticmethod
    def step_budget(max_num_batched_tokens: int, max_model_len: int, chunked: bool) -> int:
        """The token budget per step: without chunked prefill a whole prompt must fit."""
        return max_num_batched_tokens if chunked else max(max_num_batched_tokens, max_model_len)

    def __post_init__(self) -> None:
        owner = "SchedulerConfig"
        _positive_int(owner, "max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int(owner, "max_num_seqs", self.max_num_seqs)
        _positive_int(owner, "max_model_len", self.max_model_len)
        _require(
            isinstance(self.long_prefill_token_threshold, int)
            and self.long_prefill_token_threshold >= 0,
            owner,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            "an integer >= 0",
        )
        _require(
            self.policy in ("fcfs", "priority"),
            owner,
            "policy",
            self.policy,
            "'fcfs' or 'priority'",
        )
        if not self.enable_chunked_prefill:
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                owner,
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f">= max_model_len ({self.max_model_len}) when chunked prefill is off",
            )


@dataclass
class LoRAConfig:
    """Multi-LoRA serving: ``max_loras`` adapters on the device at once, each in a fixed
    slot padded to ``max_lora_rank``; up to ``max_cpu_loras`` kept on the host (least
    recently used evicted); no step mixes more adapters than there are slots."""

    max_loras: int = 1
    max_lora_rank: int = 16
    # None: max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        owner = "LoRAConfig"
        _positive_int(owner, "max_loras", self.max_loras)
        _positive_int(owner, "max_lora_rank", self.max_lora_rank)
        _require(self.max_lora_rank <= 512, owner, "max_lora_rank", self.max_lora_rank, "1 to 512")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _positive_int(owner, "max_cpu_loras", self.max_cpu_loras)
        _require(
            self.max_cpu_loras >= self.max_loras,
            owner,
            "max_cpu_loras",
            self.max_cpu_loras,
            f">= max_loras ({self.max_loras})",
        )


_REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass
class StructuredOutputsConfig:
    """Engine-wide structured-output settings (the constraint itself is per request)."""

    # Reasoning format of the model: a constraint applies only once its reasoning ends.
    reasoning_parser: str | None = None
    # Apply constraints from the first token even while the model reasons.
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        _require(
            self.reasoning_parser is None or self.reasoning_parser in _REASONING_PARSERS,
            "StructuredOutputsConfig",
            "reasoning_parser",
            self.reasoning_parser,
            f"None or one of {list(_REASONING_PARSERS)}",
        )


@dataclass
class XlmConfig:
    """The one configuration object passed around the engine."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    # None: no speculative decoding.
    speculative_config: SpeculativeConfig | None = None
    # None: LoRA adapters off (requests naming one are refused).
    lora_config: LoRAConfig | None = None
    # None: no KV cache events published.
    kv_events_config: KVEventsConfig | None = None

    def set_max_model_len(self, max_model_len: int) -> None:
        """Fix the context length everywhere once the model's limit is known."""
        _positive_int("ModelConfig", "max_model_len", max_model_len)
        sched = self.scheduler_config
        self.model_config.max_model_len = max_model_len
        sched.max_model_len = max_model_len
        sched.max_num_batched_tokens = SchedulerConfig.step_budget(
            sched.max_num_batched_tokens, max_model_len, sched.enable_chunked_prefill
        )

    def replace(self, **changes: Any) -> XlmConfig:
        """A shallow copy with some parts replaced."""
        return dataclasses.replace(self, **changes)


_current_config: XlmConfig | None = None


@contextlib.contextmanager
def set_current_xlm_config(config: XlmConfig) -> Iterator[None]:
    """Make `config` the one ops read while a model is being built."""
    global _current_config
    previous, _current_config = _current_config, config
    try:
        yield
    finally:
        _current_config = previous


def get_current_parallel_config() -> ParallelConfig:
    """The ParallelConfig of the model being built (one device outside of one)."""
    if _current_config is None:
        return ParallelConfig()
    return _current_config.parallel_config


def get_current_lora_config() -> LoRAConfig | None:
    """The LoRAConfig of the model being built (None: no LoRA parameters)."""
    return None if _current_config is None else _current_config.lora_config


def get_current_quantization() -> tuple[str | None, Any]:
    """(quantization, quant_layout) of the model being built ((None, None): float weights)."""
    if _current_config is None:
        return None, None
    model = _current_config.model_config
    return model.quantization, model.quant_layout


def get_current_weight_dtype() -> Any:
    """The dtype the model being built stores its float projections and embeddings in,
    when not its activations' dtype (None: the same)."""
    return None if _current_config is None else _current_config.model_config.weight_dtype


def get_current_compilation_config() -> CompilationConfig:
    """The CompilationConfig of the model being built (defaults outside of one)."""
    if _current_config is None:
        return CompilationConfig()
    return _current_config.compilation_config
