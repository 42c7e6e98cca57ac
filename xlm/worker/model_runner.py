"""The model runner: scheduler output -> padded ragged batch -> the step's programs -> tokens.

The runner owns the model state, the KV cache and the step's host state. Per-request
state lives in the InputBatch (updated from each SchedulerOutput) and a step's padded
arrays are built from it by xlm.worker.step_inputs; the program bodies and their specs are
xlm.worker.programs'; which programs exist and how they are compiled, saved and warmed up
is xlm.worker.compilation's; prompt logprobs are xlm.worker.prompt_logprobs'. Every step's
inputs travel to the device in one packed transfer, and the KV cache is donated to the
step so XLA updates it in place. A pooling model's runner is
xlm.worker.pooling_model_runner's subclass.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlm.config import XlmConfig
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.distributed.mesh import put_replicated, replicated, to_host
from xlm.lora.adapter import LoRASpec
from xlm.lora.slots import LoRASlots
from xlm.metrics import startup
from xlm.models.loader import resolve_dtype
from xlm.multimodal.budget import encoder_cache_slots, tokens_per_image
from xlm.worker import prompt_logprobs
from xlm.worker.buckets import Buckets
from xlm.worker.compilation import (
    BucketReadiness,
    MeshSpec,
    ProgramKey,
    ProgramKind,
    ProgramSpec,
    ProgramStore,
    engine_fingerprint,
    executable_cache_dir,
)
from xlm.worker.encoder_cache import EncoderRunner, ImageCountLayout
from xlm.worker.executable_cache import ExecutableCache
from xlm.worker.host_kv_cache import HostKVCache
from xlm.worker.input_batch import InputBatch
from xlm.worker.kv_allocation import KVCacheAllocation
from xlm.worker.packing import pack
from xlm.worker.programs import StepPrograms
from xlm.worker.prompt_logprobs import PROMPT_LOGPROB_ROWS
from xlm.worker.sleep_mode import (
    SleepRecord,
    check_weights,
    device_bytes,
    drop_weights,
    flat_variables,
    restore_weights,
    swap_weights,
)
from xlm.worker.spec_decode import Proposer, Speculator
from xlm.worker.step_inputs import StepInputs, prepare_inputs
from xlm.worker.step_outputs import StepInFlight, read_sampled

# Unseeded requests draw from a key counter: the engine seed in the bits above 20,
# advanced once per step, so each step's draws differ and the seed decides them all.
SAMPLING_KEY_SEED_SHIFT = 20


class ModelRunner:
    """Owns the model, the KV cache and the jitted step; turns SchedulerOutputs into tokens."""

    def __init__(
        self,
        config: XlmConfig,
        model: nnx.Module,
        num_blocks: int,
        kv_dtype: jnp.dtype,
        mesh: jax.sharding.Mesh | None = None,
        abstract: bool = False,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        # A compile target's runner (xlm plan): ShapeDtypeStructs on the target's mesh, for
        # program_specs() to lower; it never runs a step or saves a program.
        self.abstract = abstract
        sched, cache = config.scheduler_config, config.cache_config
        self.block_size = cache.block_size
        self.max_model_len = sched.max_model_len
        self.max_num_seqs = sched.max_num_seqs
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.buckets = Buckets.from_config(config)
        # None: one device; else the (data, model) mesh the weights and cache live on.
        self.device_mesh = mesh
        self.mesh = MeshSpec.of(mesh)
        self.vocab_size = config.model_config.hf_config.vocab_size
        self.hidden_size = config.model_config.hf_config.hidden_size
        self.input_batch = InputBatch(
            self.max_num_seqs,
            self.max_model_len,
            self.max_blocks_per_req,
            self.vocab_size,
            len(cache.kv_cache_groups or ()),
        )
        self.graphdef, self.state = nnx.split(model)
        self.num_blocks = num_blocks
        self._kv_spec = model.make_kv_caches(
            num_blocks, self.block_size, kv_dtype, mesh=mesh, abstract=True
        )
        self._kv_cache = KVCacheAllocation(self._kv_spec, allocate=not abstract)
        self._sleep: SleepRecord | None = None  # asleep: what wake_up needs
        # Host KV tier on: the host memory of evicted blocks and each step's copies.
        self.host_kv: HostKVCache | None = None
        if cache.num_host_blocks and not abstract:
            self.host_kv = HostKVCache(self._kv_spec, cache.num_host_blocks, num_blocks, mesh)
        # LoRA on: each step's tokens carry their adapter's device slot; the slots are
        # filled from the host cache (xlm.lora.slots) before a step that needs them.
        lora = config.lora_config
        self.lora_enabled = lora is not None
        self.lora: LoRASlots | None = None
        if lora is not None and not abstract:
            self.lora = LoRASlots(self.state, LoRASpec.of(model, lora.max_lora_rank), lora, mesh)
        self.sampling_key = config.model_config.seed << SAMPLING_KEY_SEED_SHIFT
        pooling = config.model_config.is_pooling
        self.programs = StepPrograms(self.graphdef, self.buckets, self._kv_spec, mesh, pooling)
        self._init_encoder(config, model)
        # Steps dispatched and not yet collected, oldest first (async scheduling keeps one
        # in flight while the next is scheduled; execute_model collects at once).
        self._in_flight: deque[StepInFlight | None] = deque()
        # The last dispatched step's sampled tokens (device, padded to the largest sampler
        # bucket) and which row each sampling request had: a token the host does not know
        # yet is read from there by the next step's program.
        self._max_rows = self.programs.max_rows
        self._prev_sampled = self._device_zeros((self._max_rows,), jnp.int32)
        self._prev_rows: dict[str, int] = {}
        # Speculative decoding: proposals after each step (xlm.worker.spec_decode).
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            self.speculator = Speculator.of(
                config.speculative_config, proposer, self.buckets.token_bucket
            )
        self.program_store = ProgramStore(
            ExecutableCache(
                None if abstract else executable_cache_dir(config),
                engine_fingerprint(config, num_blocks, kv_dtype, self.mesh),
            )
        )
        keys = {b: self._bucket_keys(b) for b in self.buckets.token_buckets}
        self.readiness = BucketReadiness(self.program_store, self.buckets, keys)

    def _init_encoder(self, config: XlmConfig, model: nnx.Module) -> None:
        """A multimodal model's encoder cache (xlm.worker.encoder_cache) and its pool; an
        M-RoPE model's step positions ([3, T], from the model's mrope_positions)."""
        hf_config, model_dir = config.model_config.hf_config, config.model_config.model
        max_tokens = config.scheduler_config.max_num_batched_tokens
        slots = encoder_cache_slots(hf_config, max_tokens, model_dir)
        self.encoder: EncoderRunner | None = None
        self.mm_pool: Any = None
        self._to_encode: list[Any] = []
        self._mrope = getattr(model, "mrope_positions", None)
        if not slots:
            return
        per_image = tokens_per_image(hf_config, model_dir)
        if hasattr(model, "encoder_layout"):  # images of varying size (Qwen2-VL)
            layout = model.encoder_layout(hf_config, model_dir)
        else:  # images of one size (LLaVA)
            vision = hf_config.vision_config
            shape = (vision.num_channels, vision.image_size, vision.image_size)
            layout = ImageCountLayout(slots, shape, per_image)
        self.encoder = EncoderRunner(
            self.graphdef, self.state, slots, per_image, self.hidden_size, self.device_mesh, layout
        )
        self.mm_pool = self._device_zeros(self.encoder.pool_shape(), self.encoder.dtype)

    def encoder_cache_stats(self) -> dict[str, int]:
        """Images found in the encoder cache (hits) and encoded (misses) so far."""
        if self.encoder is None:
            return {"hits": 0, "misses": 0}
        return {"hits": self.encoder.cache.hits, "misses": self.encoder.cache.misses}

    def _encoder_spec(self, bucket: int) -> ProgramSpec:
        pool = self._replicated_shape(self.encoder.pool_shape(), self.encoder.dtype)
        inputs, rows = self.encoder.spec_args(bucket, self._replicated_shape)
        out_tree = jax.tree_util.tree_structure(0)
        args = (self.state, pool, inputs, rows)
        return ProgramSpec(self.encoder.encode_fn, args, None, out_tree, self.device_mesh)

    def _encoder_program(self, bucket: int) -> Any:
        key = self._key(ProgramKind.ENCODER, bucket)
        return self.program_store.get(key, lambda: self._encoder_spec(bucket))

    @property
    def proposer(self) -> Proposer | None:
        return None if self.speculator is None else self.speculator.proposer

    @property
    def token_buckets(self) -> list[int]:
        return list(self.buckets.token_buckets)

    @property
    def num_compilations(self) -> int:
        """Programs compiled or loaded so far (a draft model's included); after warm-up it
        must not move."""
        host = 0 if self.host_kv is None else self.host_kv.num_compilations
        return host + sum(s.num_compilations for s in self._program_stores())

    def _program_stores(self) -> list[ProgramStore]:
        draft = getattr(self.proposer, "runner", None)
        return [self.program_store] + ([draft.program_store] if draft is not None else [])

    def programs_ready(self) -> tuple[int, int]:
        """(ready, registered) step programs, a draft model's included."""
        stores = self._program_stores()
        return sum(s.num_ready for s in stores), sum(s.num_registered for s in stores)

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation; whether every program is ready."""
        return all([s.wait(timeout) for s in self._program_stores()])

    def shutdown(self) -> None:
        """Stop background compilation (a draft model's too) and the host tier's writer."""
        for store in self._program_stores():
            store.shutdown()
        if self.host_kv is not None:
            self.host_kv.shutdown()

    # ---- sleep mode and weight updates (xlm.worker.sleep_mode) -----------------------
    @property
    def sleep_level(self) -> int | None:
        """The level this runner sleeps at, or None when awake."""
        return None if self._sleep is None else self._sleep.level

    def device_bytes(self) -> tuple[int, int]:
        """(weights, KV cache) bytes this runner holds on this process's devices now."""
        arrays = {id(v.get_value()): v.get_value() for v in flat_variables(self.state).values()}
        weights = sum(device_bytes(a) for a in arrays.values())  # a shared array once
        kv = 0 if self._sleep is not None else sum(device_bytes(a) for a in self.kv_caches)
        return weights, kv

    def sleep(self, level: int) -> SleepRecord:
        """Free the weights (level 1: kept in host memory) and the KV cache."""
        host, freed_weights = drop_weights(self.state, level)
        caches = self.kv_caches
        freed_kv = sum(device_bytes(a) for a in caches)
        for array in caches:
            array.delete()
        self._kv_cache.arrays = []
        self._sleep = SleepRecord(level, host, freed_weights, freed_kv)
        return self._sleep

    def wake_up(self, fresh: nnx.State | None = None) -> None:
        """Put the weights back (level 2: `fresh`, the checkpoint read again) and a zeroed
        KV cache, each as it was placed: the compiled programs take them."""
        record, self._sleep = self._sleep, None
        restore_weights(self.state, record.host, fresh)
        self._kv_cache = KVCacheAllocation(self._kv_spec)

    def update_weights(self, fresh: nnx.State, source: str) -> None:
        """Take `fresh`'s tensors as the weights; ValueError (nothing changed) when a
        tensor's shape or dtype differs."""
        check_weights(self.state, fresh, source)
        swap_weights(self.state, fresh)

    @property
    def kv_caches(self) -> list[Any]:
        """The KV cache arrays (waits for their allocation the first time)."""
        return self._kv_cache.arrays

    @kv_caches.setter
    def kv_caches(self, value: list[Any]) -> None:
        self._kv_cache.arrays = value

    def _put(self, value: np.ndarray) -> jax.Array:
        """Host array -> device(s): replicated over the mesh when there is one."""
        return put_replicated(value, self.device_mesh)

    def _replicated_shape(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        """An array's shape, dtype and sharding (replicated), for specs to lower with."""
        sharding = None if self.device_mesh is None else replicated(self.device_mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def _device_zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """Zeros on the device(s), or their shape on a compile target's runner."""
        if self.abstract:
            return self._replicated_shape(shape, dtype)
        return self._put(np.zeros(shape, dtype))

    def _key(self, kind: ProgramKind, size: int) -> ProgramKey:
        return ProgramKey(kind, size, self.mesh)

    # ---- host side -------------------------------------------------------------------
    def _prepare_inputs(
        self,
        req_ids: list[str],
        num_scheduled: list[int],
        num_tokens_padded: int,
        scheduler_output: SchedulerOutput | None = None,
        spec_lens: np.ndarray | None = None,
    ) -> StepInputs:
        """Build the padded ragged batch (xlm.worker.step_inputs) and advance the key."""
        lora_slots = None
        if self.lora is not None:
            states = self.input_batch.requests
            lora_slots = self.lora.slots_for([states[r].lora_request for r in req_ids])
        elif self.lora_enabled:  # a compile target's runner: program shapes only
            lora_slots = np.zeros(len(req_ids), np.int32)
        out = prepare_inputs(
            self.input_batch,
            self.buckets,
            self.block_size,
            self._prev_rows,
            self.sampling_key,
            req_ids,
            num_scheduled,
            num_tokens_padded,
            scheduler_output,
            spec_lens,
            lora_slots,
        )
        self.sampling_key += 1
        if self.encoder is not None:
            batch = self.input_batch
            features = [batch.requests[r].mm_features for r in req_ids]
            starts = batch.num_computed_tokens[batch.slots(req_ids)] if req_ids else []
            starts, counts = np.asarray(starts), np.asarray(num_scheduled)
            mm_rows, self._to_encode = self.encoder.step_rows(
                features, starts, counts, num_tokens_padded
            )
            out.arrays["mm_rows"] = mm_rows
            if self._mrope is not None:
                positions = self._mrope(features, starts, counts, num_tokens_padded)
                out.arrays["attn"] = dataclasses.replace(out.arrays["attn"], positions=positions)
        return out

    def _run_model(self, num_tokens_padded: int, arrays: dict[str, Any]) -> tuple[Any, Any]:
        """Launch the step's model program; its logits (None when pooling) and hidden."""
        packed, layout = pack(arrays)
        if self._to_encode:  # the step's images not in the encoder cache, first
            self.mm_pool = self.encoder.encode(
                self._encoder_program, self.state, self.mm_pool, self._to_encode
            )
            self._to_encode = []
        model_args = (
            self.state,
            self.kv_caches,
            self._put(packed),
            self._prev_sampled,
            self.mm_pool,
        )
        program = self.program_store.get(
            self._key(ProgramKind.MODEL, num_tokens_padded),
            lambda: self.programs.model_spec(self.state, *model_args[2:], layout),
            layout,
        )
        self.kv_caches, logits, hidden = program(*model_args)
        return logits, hidden

    def _run(self, step: StepInputs) -> Any:
        """Launch the step's model and sampler programs; returns their device outputs
        (the sampler's and the hidden states) without waiting for them."""
        (logits, few_logits), hidden = self._run_model(step.shape.num_tokens, step.arrays)
        if step.shape.few_rows:  # the model program output the few-rows logits apart
            logits = few_logits
        packed, layout = pack(step.sampling)
        sample_args = (logits, self._put(packed))
        program = self.program_store.get(
            self._key(ProgramKind.SAMPLER, step.shape.sampler_rows),
            lambda: self.programs.sampler_spec(*sample_args, layout),
            layout,
        )
        return program(*sample_args), hidden

    def _run_prompt_logprobs(self, hidden: np.ndarray, ids: np.ndarray) -> tuple:
        args = (self.state, self._put(hidden), self._put(ids))
        program = self.program_store.get(
            self._key(ProgramKind.PROMPT_LOGPROBS, PROMPT_LOGPROB_ROWS),
            lambda: self.programs.prompt_logprobs_spec(*args),
        )
        return to_host(program(*args))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and return the sampled tokens per request."""
        self.dispatch(scheduler_output)
        return self.collect()

    def dispatch(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a SchedulerOutput and launch its step on the device, without waiting.

        `collect` returns the results, oldest step first. A step dispatched before the
        previous one is collected (async scheduling) reads that step's sampled tokens on
        the device where its scheduler counted a token in flight.
        """
        started = time.perf_counter()
        transfers = scheduler_output.kv_transfers
        if transfers is not None and self.host_kv is not None:
            # Before the forward: saves read blocks this step may overwrite, loads fill
            # blocks it reads.
            self.kv_caches = self.host_kv.apply(self.kv_caches, transfers)
        batch = self.input_batch
        if self.lora is not None:
            self.lora.track(scheduler_output, self._adapter_of)
        batch.update(scheduler_output)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        if not req_ids:
            self._prev_rows = {}
            self._in_flight.append(None)
            return
        num_scheduled = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        num_tokens_padded = self.readiness.ready_bucket(scheduler_output.total_num_scheduled_tokens)
        spec_lens = None
        if self.speculator is not None:
            proposals = scheduler_output.scheduled_spec_decode_tokens
            spec_lens = self.speculator.write_proposals(batch, req_ids, proposals)
        step = self._prepare_inputs(
            req_ids, num_scheduled, num_tokens_padded, scheduler_output, spec_lens
        )
        in_flight = self._launch(req_ids, num_scheduled, step)
        in_flight.spec_lens, in_flight.started = spec_lens, started
        self._in_flight.append(in_flight)

    def _adapter_of(self, req_id: str) -> Any:
        state = self.input_batch.requests.get(req_id)
        return None if state is None else state.lora_request

    def _launch(
        self, req_ids: list[str], num_scheduled: list[int], step: StepInputs
    ) -> StepInFlight:
        """Launch the step's programs and count its tokens as computed."""
        sampled, hidden = self._run(step)
        plan = prompt_logprobs.plan(self.input_batch, req_ids, num_scheduled)
        self.input_batch.advance(req_ids, num_scheduled)
        self._prev_sampled = sampled.sampled_token_ids
        self._prev_rows = {r: i for i, r in enumerate(req_ids) if step.has_output[i]}
        return StepInFlight(
            req_ids,
            step.has_output,
            sampled,
            hidden if plan.rows else None,
            plan,
            row_counts=step.row_counts,
            bucket=step.shape.num_tokens,
        )

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest dispatched step; record and return its outputs."""
        step = self._in_flight.popleft()
        if step is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self._outputs(step)

    def _outputs(self, step: StepInFlight) -> ModelRunnerOutput:
        """The step's sampled tokens (and logprobs), recorded in the batch."""
        prompt_lps = prompt_logprobs.compute(
            step.prompt_plan, step.hidden, self._run_prompt_logprobs
        )
        policy = None if self.speculator is None else self.speculator.policy
        token_ids, logprobs = read_sampled(step, self.input_batch, policy)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
            spec_token_ids=self._propose(step),
        )

    def _propose(self, step: StepInFlight) -> list[list[int]] | None:
        """The next proposals (speculative decoding), after timing the step."""
        if self.speculator is None:
            return None
        # Synchronous steps (speculation turns async scheduling off): dispatch to here
        # is the step's time.
        self.speculator.policy.record_step(step.bucket, time.perf_counter() - step.started)
        req_ids = [r if step.has_output[i] else "" for i, r in enumerate(step.req_ids)]
        return self.speculator.propose(self.input_batch, req_ids)

    # ---- programs --------------------------------------------------------------------
    def program_specs(self) -> dict[ProgramKey, ProgramSpec]:
        """Every program serving may need: one model program per token bucket with the
        programs that read its outputs (_bucket_specs), and the others (_other_specs)."""
        specs: dict[ProgramKey, ProgramSpec] = {}
        for bucket in self.buckets.token_buckets:
            arrays = self._prepare_inputs([], [], bucket).arrays
            packed, layout = pack(arrays)
            packed = self._replicated_shape(packed.shape, packed.dtype)
            prev_sampled = self._replicated_shape((self._max_rows,), jnp.int32)
            pool = None
            if self.encoder is not None:
                pool = self._replicated_shape(self.encoder.pool_shape(), self.encoder.dtype)
            model_spec = self.programs.model_spec(self.state, packed, prev_sampled, pool, layout)
            specs[self._key(ProgramKind.MODEL, bucket)] = model_spec
            specs.update(self._bucket_specs(bucket, arrays, model_spec))
        specs.update(self._other_specs())
        return specs

    def _bucket_specs(
        self, bucket: int, arrays: dict[str, Any], model_spec: ProgramSpec
    ) -> dict[ProgramKey, ProgramSpec]:
        """The samplers a step of this token bucket may run (its rows follow the bucket)."""
        specs = {}
        for rows in self.buckets.sampler_buckets_for_tokens(bucket):
            sampling = self.input_batch.sampling_metadata(np.zeros(0, np.intp), rows, 0)
            packed, layout = pack(sampling)
            packed = self._replicated_shape(packed.shape, packed.dtype)
            logits = self._replicated_shape((rows, self.vocab_size), jnp.float32)
            specs[self._key(ProgramKind.SAMPLER, rows)] = self.programs.sampler_spec(
                logits, packed, layout
            )
        return specs

    def _other_specs(self) -> dict[ProgramKey, ProgramSpec]:
        """The prompt-logprobs program (and a multimodal model's encoder programs)."""
        # The hidden states' dtype: the model's (not its first leaf's, which may be an int8
        # embedding table under quantization).
        model_config = self.config.model_config
        dtype = resolve_dtype(model_config.dtype, model_config.hf_config)
        hidden = self._replicated_shape((PROMPT_LOGPROB_ROWS, self.hidden_size), dtype)
        ids = self._replicated_shape((PROMPT_LOGPROB_ROWS,), jnp.int32)
        key = self._key(ProgramKind.PROMPT_LOGPROBS, PROMPT_LOGPROB_ROWS)
        specs = {key: self.programs.prompt_logprobs_spec(self.state, hidden, ids)}
        if self.encoder is not None:  # the encoder, by image count
            for bucket in self.encoder.buckets:
                specs[self._key(ProgramKind.ENCODER, bucket)] = self._encoder_spec(bucket)
        return specs

    def _bucket_keys(self, bucket: int) -> list[ProgramKey]:
        """The programs a step of this token bucket runs (the model and its samplers)."""
        rows = self.buckets.sampler_buckets_for_tokens(bucket)
        samplers = [self._key(ProgramKind.SAMPLER, r) for r in rows]
        return [self._key(ProgramKind.MODEL, bucket), *samplers]

    def warmup(self, startup_programs: str = "all") -> None:
        """Make programs ready before serving (xlm.worker.compilation.BucketReadiness)."""
        draft = getattr(self.proposer, "runner", None)
        if draft is not None:
            draft.warmup(startup_programs)
        if self.host_kv is not None:
            self.host_kv.compile()
        self.readiness.warmup(self.program_specs(), startup_programs)
        startup.note("programs", self.program_store.summary())
