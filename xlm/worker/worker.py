"""The worker: one device set (a mesh under tensor parallelism), its model and KV cache."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from flax import nnx

from pallas_kernels.ragged_paged_attention import cache_row_width
from xlm import envs, platforms
from xlm.config import XlmConfig, kv_cache_dtype_name
from xlm.core.block_pool import BlockPool
from xlm.core.kv_cache_groups import KVCacheGroupSpec, blocks_for_request, group_layers
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.distributed.coordination import agree_min
from xlm.distributed.mesh import describe_mesh, make_mesh, per_device_bytes
from xlm.logger import init_logger
from xlm.lora.request import LoRARequest
from xlm.metrics import startup
from xlm.models.loader import get_model, load_hf_config, resolve_dtype
from xlm.multimodal.budget import encoder_pool_bytes
from xlm.multimodal.processor_config import resolve_processor_config
from xlm.platforms.cpu import DEFAULT_CPU_KV_CACHE_GIB
from xlm.platforms.target import CompileTarget, compile_target
from xlm.worker.host_kv_cache import host_block_bytes
from xlm.worker.model_runner import ModelRunner
from xlm.worker.pooling_model_runner import PoolingModelRunner
from xlm.worker.spec_decode import DraftModelProposer

logger = init_logger(__name__)

GiB = 1 << 30


class KVCacheTooSmallError(ValueError):
    """The memory left for the KV cache cannot hold one request of max_model_len."""

    def __init__(
        self,
        message: str,
        *,
        num_blocks: int,
        needed_blocks: int,
        block_bytes: int,
        weight_bytes: int,
    ) -> None:
        super().__init__(message)
        self.num_blocks = num_blocks
        self.needed_blocks = needed_blocks
        self.block_bytes = block_bytes  # per device (per process on CPU)
        self.weight_bytes = weight_bytes  # on the fullest device


def kv_cache_bytes_per_block(model, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes of one block's K and V over all layers (an int8 row carries its 4-byte scale)."""
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    row = cache_row_width(head_dim, dtype)
    return num_layers * 2 * block_size * num_kv_heads * row * jnp.dtype(dtype).itemsize


def shared_sliding_window(model) -> int | None:
    """The window every attention layer uses, or None (a full-attention layer, mixed windows,
    or a model that does not report its windows)."""
    windows = set(model.sliding_windows()) if hasattr(model, "sliding_windows") else {None}
    return windows.pop() if len(windows) == 1 else None


def use_kv_cache_groups(model) -> list[KVCacheGroupSpec] | None:
    """Give a model of several attention windows one block table per group (arrays shared
    across groups, so a block costs one group's layers); the groups, or None for one."""
    groups = kv_cache_groups(model)
    if len(groups) > 1:
        model.use_kv_cache_groups(groups)
        return groups
    return None


def kv_cache_groups(model) -> list[KVCacheGroupSpec]:
    """The model's KV cache groups by layer window (one group: a single block table)."""
    if not hasattr(model, "sliding_windows"):
        return []
    return group_layers(model.sliding_windows())


class Worker:
    """Loads the model, sizes and allocates the KV cache, and runs steps.

    One per process: under `multihost` every process owns a Worker over its share of the
    global mesh, and the executor drives them; that is why it stays a layer of its own
    above the runner (which only prepares inputs and runs programs).
    """

    def __init__(self, config: XlmConfig) -> None:
        self.config = config

        parallel = config.parallel_config
        # A compile target (xlm plan): the slice's abstract devices, nothing allocated.
        self.target: CompileTarget | None = None
        if parallel.target_topology is not None:
            self.target = compile_target(parallel.target_topology)
        # One device in one process needs no mesh; anything else runs on the global mesh
        # (a target always has one: abstract arrays need a sharding on its devices).
        single = parallel.world_size == 1 and not parallel.is_multihost and not self.target
        devices = None if self.target is None else self.target.devices
        self.mesh = None if single else make_mesh(parallel, devices)
        logger.info("Devices: %s.", describe_mesh(self.mesh))
        with startup.phase("weights"):
            self.model = get_model(config, mesh=self.mesh, abstract=self.target is not None)
        model_config = config.model_config
        cache_dtype = config.cache_config.cache_dtype
        self.kv_dtype = (
            resolve_dtype(model_config.dtype, model_config.hf_config)
            if cache_dtype == "auto"
            else jnp.dtype(kv_cache_dtype_name(cache_dtype))
        )
        config.cache_config.kv_cache_groups = use_kv_cache_groups(self.model)
        # Speculative decoding with a draft model: its weights beside the target's (before
        # the cache is sized, which counts the draft's K/V in each block).
        spec = config.speculative_config
        self.draft_model = self.draft_config = None
        if spec is not None and spec.method == "draft_model":
            self.draft_config = config.replace(
                model_config=spec.draft_model_config,
                cache_config=dataclasses.replace(config.cache_config),
                speculative_config=None,
                lora_config=None,  # the draft proposes with the base weights
            )
            with startup.phase("draft weights"):
                self.draft_model = get_model(
                    self.draft_config, mesh=self.mesh, abstract=self.target is not None
                )
            self.draft_config.cache_config.kv_cache_groups = use_kv_cache_groups(self.draft_model)
        self.num_blocks = self._determine_num_blocks()
        config.cache_config.num_blocks = self.num_blocks
        config.cache_config.sliding_window = shared_sliding_window(self.model)
        # The config the weights are read from again (sleep level 2): update_weights
        # points it at the new checkpoint.
        self._weights_config = config
        num_host, host_bytes = self._determine_host_blocks()
        config.cache_config.num_host_blocks = num_host
        config.cache_config.host_block_bytes = host_bytes
        runner_cls = PoolingModelRunner if config.model_config.is_pooling else ModelRunner
        with startup.phase("KV cache"):
            self.model_runner = runner_cls(
                config,
                self.model,
                self.num_blocks,
                self.kv_dtype,
                mesh=self.mesh,
                abstract=self.target is not None,
                proposer=self._draft_proposer(),
            )

    def _draft_groups(self) -> int:
        """The draft model's KV cache groups (1 without groups)."""
        return len(self.draft_config.cache_config.kv_cache_groups or ()) or 1

    def _draft_proposer(self) -> DraftModelProposer | None:
        """A draft model's proposer: its own runner on a pool of blocks for every target
        block, per draft group, and room for k more tokens per request."""
        if self.draft_model is None:
            return None
        config = self.draft_config
        k = self.config.speculative_config.num_speculative_tokens
        block_size = config.cache_config.block_size
        per_request = -(-k // block_size) + 1
        groups = self._draft_groups()
        num_blocks = groups * (self.num_blocks + config.scheduler_config.max_num_seqs * per_request)
        config.cache_config.num_blocks = num_blocks
        config.cache_config.sliding_window = shared_sliding_window(self.draft_model)
        dtype = resolve_dtype(config.model_config.dtype, config.model_config.hf_config)
        runner = ModelRunner(
            config,
            self.draft_model,
            num_blocks,
            dtype if self.config.cache_config.cache_dtype == "auto" else self.kv_dtype,
            mesh=self.mesh,
            abstract=self.target is not None,
        )
        logger.info(
            "Draft model %s: %d KV cache blocks of its own.", config.model_config.model, num_blocks
        )
        pool = BlockPool(num_blocks, enable_caching=False)
        return DraftModelProposer(runner, pool, len(config.cache_config.kv_cache_groups or ()))

    def weight_bytes_per_device(self) -> int:
        """Bytes of parameters the fullest device holds (its shards, replicas included)."""
        return max(per_device_bytes(nnx.state(self.model)).values())

    def encoder_weight_bytes_per_device(self, elements: bool = False) -> int:
        """Bytes (or `elements`) of the vision encoder's parameters (a multimodal model's
        `encoder_modules`, replicated) the fullest device holds; 0 for a text model."""
        names = getattr(self.model, "encoder_modules", ())
        if not names:
            return 0
        states = [nnx.state(getattr(self.model, name)) for name in names]
        return max(per_device_bytes(states, elements=elements).values())

    def _memory_in_use(self) -> tuple[int, int]:
        """(device memory, bytes in use now): the platform's statistics, or for a compile
        target the chip's HBM with the weights' shards as the bytes in use."""
        platform = platforms.current_platform
        total = platform.get_device_total_memory()
        if self.target is not None:
            return total, self.weight_bytes_per_device()
        return total, total - platform.get_device_free_memory()

    def encoder_cache_bytes(self) -> int:
        """Bytes of the encoder cache's device pool on each device (0: a text model)."""
        model_config = self.config.model_config
        itemsize = jnp.dtype(resolve_dtype(model_config.dtype, model_config.hf_config)).itemsize
        tokens = self.config.scheduler_config.max_num_batched_tokens
        return encoder_pool_bytes(
            model_config.hf_config, tokens, itemsize, resolve_processor_config(self.config)
        )

    def blocks_for_one_request(self) -> int:
        """The fewest blocks that serve one request of max_model_len (and the null block)."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        groups = cache.kv_cache_groups or [KVCacheGroupSpec(None, ())]
        return (
            blocks_for_request(
                groups, sched.max_model_len, cache.block_size, sched.max_num_batched_tokens
            )
            + 1
        )

    def _determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        per_block = kv_cache_bytes_per_block(self.model, cache.block_size, self.kv_dtype)
        if self.draft_model is not None:  # the draft's K/V for each block's tokens
            per_block += self._draft_groups() * kv_cache_bytes_per_block(
                self.draft_model, cache.block_size, self.kv_dtype
            )
        platform = platforms.current_platform
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        elif platform.is_cpu() or platform.get_device_free_memory() is None:
            # No memory statistics (CPU, or an out-of-tree platform whose backend reports
            # none): a configured size, else XLM_CPU_KVCACHE_SPACE, else the default.
            gib = cache.kv_cache_memory
            if gib is None:
                gib = envs.XLM_CPU_KVCACHE_SPACE or DEFAULT_CPU_KV_CACHE_GIB
            num_blocks = int(gib * GiB // per_block)
        else:
            # Device memory left after the weights, within the utilization budget.
            total, in_use = self._memory_in_use()
            budget = total * cache.memory_utilization - in_use
            # Memory figures are per device; each device holds 1/tp of every block.
            per_block = -(-per_block // self.config.parallel_config.tensor_parallel_size)
            # Keep headroom for activations of the largest step (logits dominate).
            sched = self.config.scheduler_config
            hidden_size = self.config.model_config.hf_config.hidden_size
            activation = sched.max_num_batched_tokens * hidden_size * 4 * 16
            # The encoder cache's pool (a multimodal model) is allocated beside the cache.
            encoder = self.encoder_cache_bytes()
            num_blocks = int(max(budget - activation - encoder, 0) // per_block)
        if cache.num_blocks is None:
            # One global cache needs one size: the smallest of all processes'.
            num_blocks = agree_min("num_blocks", num_blocks)
        needed = self.blocks_for_one_request()
        if num_blocks < needed:
            raise KVCacheTooSmallError(
                f"KV cache of {num_blocks} blocks ({num_blocks * per_block / GiB:.2f} GiB) "
                f"cannot hold one request of max_model_len="
                f"{self.config.scheduler_config.max_model_len} ({needed} blocks); raise "
                f"kv_cache_memory / memory_utilization or lower max_model_len",
                num_blocks=num_blocks,
                needed_blocks=needed,
                block_bytes=per_block,
                weight_bytes=self.weight_bytes_per_device(),
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s).",
            num_blocks,
            cache.block_size,
            num_blocks * per_block / GiB,
            jnp.dtype(self.kv_dtype),
        )
        return num_blocks

    def _determine_host_blocks(self) -> tuple[int, int]:
        """The host KV tier's (blocks, bytes per block) in this process; (0, 0): off."""
        cache = self.config.cache_config
        if cache.kv_offloading_size <= 0 or self.target is not None:
            return 0, 0
        if not cache.enable_prefix_caching:
            logger.warning(
                "kv_offloading_size=%s ignored: the host KV tier needs prefix caching.",
                cache.kv_offloading_size,
            )
            return 0, 0
        spec = self.model.make_kv_caches(
            1, cache.block_size, self.kv_dtype, mesh=self.mesh, abstract=True
        )
        block_bytes = host_block_bytes(spec)
        num_host = agree_min("num_host_blocks", int(cache.kv_offloading_size * GiB // block_bytes))
        if num_host == 0:
            logger.warning(
                "kv_offloading_size=%s GiB holds no block of %d bytes: no host KV tier.",
                cache.kv_offloading_size,
                block_bytes,
            )
            return 0, 0
        logger.info(
            "Host KV tier: %d blocks of %d tokens (%.2f GiB of host memory).",
            num_host,
            cache.block_size,
            num_host * block_bytes / GiB,
        )
        return num_host, block_bytes

    def warmup(self) -> None:
        mode = self.config.compilation_config.startup_programs
        if self.config.parallel_config.is_multihost:
            mode = "all"  # followers mirror the leader's calls: the same buckets everywhere
        with startup.phase("programs"):
            self.model_runner.warmup(mode)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def dispatch(self, scheduler_output: SchedulerOutput) -> None:
        self.model_runner.dispatch(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        return self.model_runner.collect()

    # ---- LoRA adapters (xlm.lora.slots; EngineCore refuses these calls with LoRA off) ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter into the host cache (LoRAAdapterError when bad)."""
        self.model_runner.lora.add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.lora.remove(lora_id)

    def list_loras(self) -> list[int]:
        return self.model_runner.lora.list()

    # ---- sleep mode and weight updates (xlm.worker.sleep_mode) ---------------------------
    def _runners(self) -> list[tuple[ModelRunner, XlmConfig]]:
        """Each runner with the config its weights are read from (a draft model's too)."""
        runners = [(self.model_runner, self._weights_config)]
        draft = getattr(self.model_runner.proposer, "runner", None)
        if draft is not None:
            runners.append((draft, self.draft_config))
        return runners

    def device_bytes(self) -> dict[str, int]:
        """Bytes of weights and KV cache on this process's devices now (a draft's included)."""
        sizes = [runner.sleep_mode.device_bytes() for runner, _ in self._runners()]
        return {"weights": sum(w for w, _ in sizes), "kv_cache": sum(k for _, k in sizes)}

    def sleep(self, level: int) -> dict[str, int]:
        """Free the weights (level 1: to host memory; level 2: dropped) and the KV cache;
        the device bytes freed."""
        records = [runner.sleep_mode.sleep(level) for runner, _ in self._runners()]
        freed = {
            "weights": sum(r.freed_weight_bytes for r in records),
            "kv_cache": sum(r.freed_kv_bytes for r in records),
        }
        logger.info(
            "Sleeping (level %d): freed %.2f GiB of weights and %.2f GiB of KV cache.",
            level,
            freed["weights"] / GiB,
            freed["kv_cache"] / GiB,
        )
        return freed

    def wake_up(self) -> None:
        """Weights and a zeroed KV cache back on the devices (level 2: weights re-read)."""
        for runner, config in self._runners():
            fresh = None
            if runner.sleep_mode.level == 2:
                fresh = nnx.state(get_model(config, mesh=self.mesh))
            runner.sleep_mode.wake_up(fresh)
        logger.info("Awake: weights and KV cache are back on the devices.")

    def update_weights(self, path: str) -> None:
        """Load the target model's weights from `path` (a checkpoint directory or GGUF
        file); ValueError naming the tensor, with nothing changed, when they do not fit."""
        if not os.path.exists(path):
            raise ValueError(f"update_weights: path {path!r} does not exist")
        old = self._weights_config.model_config
        try:
            model_config = dataclasses.replace(
                old,
                model=path,
                load_format="auto",
                # The engine's dtype, not the new checkpoint's: the programs take that.
                dtype=old.dtype
                if old.dtype != "auto"
                else jnp.dtype(resolve_dtype(old.dtype, old.hf_config)).name,
                hf_config=load_hf_config(path),
            )
            config = self._weights_config.replace(model_config=model_config)
            fresh = nnx.state(get_model(config, mesh=self.mesh))
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(
                f"update_weights: could not load {path!r}: {e}; nothing was changed"
            ) from e
        self.model_runner.sleep_mode.update_weights(fresh, path)
        self._weights_config = config
        logger.info("Weights updated from %s.", path)
