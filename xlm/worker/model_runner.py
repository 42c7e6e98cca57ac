"""The model runner: scheduler output -> padded ragged batch -> the step's programs -> tokens.

The runner dispatches a step and collects it. Per-request state lives in the InputBatch
and a step's padded arrays are built from it by xlm.worker.step_inputs; the program
bodies and specs are xlm.worker.programs'; compilation, saved programs and bucket
readiness xlm.worker.compilation's; the encoder cache xlm.worker.encoder_cache's; sleep
mode xlm.worker.sleep_mode's; LoRA slots xlm.lora.slots'; speculation
xlm.worker.spec_decode's. Every step's inputs travel to the device in one packed
transfer, and the KV cache is donated to the step. A pooling model's runner is
xlm.worker.pooling_model_runner's subclass.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlm.config import XlmConfig
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.distributed.mesh import put_replicated, to_host
from xlm.lora.adapter import LoRASpec
from xlm.lora.slots import LoRASlots
from xlm.metrics import startup
from xlm.models.loader import resolve_dtype
from xlm.worker import prompt_logprobs
from xlm.worker.buckets import Buckets
from xlm.worker.compilation import (
    BucketReadiness,
    MeshSpec,
    ProgramKey,
    ProgramKind,
    ProgramSpec,
    ProgramStore,
    program_cache,
)
from xlm.worker.encoder_cache import EncoderRunner
from xlm.worker.host_kv_cache import HostKVCache
from xlm.worker.input_batch import InputBatch
from xlm.worker.kv_allocation import KVCacheAllocation
from xlm.worker.packing import pack
from xlm.worker.programs import StepPrograms, Weights
from xlm.worker.prompt_logprobs import PROMPT_LOGPROB_ROWS
from xlm.worker.sleep_mode import RunnerSleep
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
        # Sleep mode and weight updates (xlm.worker.sleep_mode).
        self.sleep_mode = RunnerSleep(self.state, self._kv_cache)
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
        # The step programs take the weights as a flat list of arrays (programs.Weights).
        self.weights = Weights(self.state)
        self.programs = StepPrograms(
            self.graphdef, self.weights, self.buckets, self._kv_spec, mesh, pooling
        )
        # A multimodal model's encoder cache and its programs (xlm.worker.encoder_cache).
        self.encoder = EncoderRunner.of(config, model, self.graphdef, self.weights, mesh, abstract)
        # Steps dispatched and not yet collected, oldest first (async scheduling keeps one
        # in flight while the next is scheduled; execute_model collects at once).
        self._in_flight: deque[StepInFlight | None] = deque()
        # The last dispatched step's sampled tokens (device, padded to the largest sampler
        # bucket) and which row each sampling request had: a token the host does not know
        # yet is read from there by the next step's program.
        self._max_rows = self.programs.max_rows
        prev_sampled = self.programs.shape((self._max_rows,), jnp.int32)
        self._prev_sampled = (
            prev_sampled if abstract else self._put(np.zeros(self._max_rows, np.int32))
        )
        self._prev_rows: dict[str, int] = {}
        # Speculative decoding: proposals after each step (xlm.worker.spec_decode).
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            self.speculator = Speculator.of(
                config.speculative_config, proposer, self.buckets.token_bucket
            )
        self._init_program_store(config, num_blocks, kv_dtype, proposer)

    def _init_program_store(
        self, config: XlmConfig, num_blocks: int, kv_dtype: Any, proposer: Proposer | None
    ) -> None:
        """The store of this runner's programs (saved ones keyed by the engine's
        fingerprint) and the readiness of its buckets, a draft model's programs counted."""
        self.program_store = ProgramStore(
            program_cache(
                config,
                (num_blocks, kv_dtype, self.mesh),
                (self.vocab_size, self._max_rows, self.programs.sampler_config),
                saved=not self.abstract,
            )
        )
        keys = {b: self._bucket_keys(b) for b in self.buckets.token_buckets}
        draft = getattr(proposer, "runner", None)
        others = [] if draft is None else [draft.program_store]
        self.readiness = BucketReadiness(self.program_store, self.buckets, keys, others)

    def encoder_cache_stats(self) -> dict[str, int]:
        """Images found in the encoder cache (hits) and encoded (misses) so far."""
        return {"hits": 0, "misses": 0} if self.encoder is None else self.encoder.stats()

    @property
    def proposer(self) -> Proposer | None:
        return None if self.speculator is None else self.speculator.proposer

    @property
    def num_compilations(self) -> int:
        """Programs compiled or loaded so far (a draft model's included); after warm-up it
        must not move."""
        host = 0 if self.host_kv is None else self.host_kv.num_compilations
        return host + self.readiness.num_compilations

    def shutdown(self) -> None:
        """Stop background compilation (a draft model's too) and the host tier's writer."""
        self.readiness.shutdown()
        if self.host_kv is not None:
            self.host_kv.shutdown()

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

    def _step_input(self, value: np.ndarray) -> Any:
        """A step's packed host inputs as its program takes them: on one device the numpy
        array itself, which the compiled call transfers in C++ (5 us against
        jax.device_put's 130 us on the 2-core dev CPU, twice a step); over a mesh, the
        replicated array."""
        return value if self.device_mesh is None else self._put(value)

    def _key(self, kind: ProgramKind, size: int) -> ProgramKey:
        return self.programs.key(kind, size)

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
        if self.lora_enabled:  # a compile target's runner (no slots): program shapes only
            loras = [self.input_batch.requests[r].lora_request for r in req_ids]
            lora_slots = self.lora.slots_for(loras) if self.lora else np.zeros(len(loras), np.int32)
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
            attn = out.arrays["attn"]
            mm_rows, changes = self.encoder.plan_step(
                self.input_batch, req_ids, num_scheduled, num_tokens_padded, attn.positions
            )
            out.arrays["mm_rows"] = mm_rows
            out.arrays["attn"] = dataclasses.replace(attn, **changes)
        return out

    def _run_model(self, num_tokens_padded: int, arrays: dict[str, Any]) -> tuple[Any, Any]:
        """Launch the step's model program; its logits (None when pooling) and hidden."""
        packed, layout = pack(arrays)
        mm_pool = None
        if self.encoder is not None:  # the step's images not in the encoder cache, first
            mm_pool = self.encoder.encode_pending(self.program_store, self.mesh)
        weights = self.weights.arrays()
        model_args = (
            weights,
            self.kv_caches,
            self._step_input(packed),
            self._prev_sampled,
            mm_pool,
        )
        program = self.program_store.get(
            self._key(ProgramKind.MODEL, num_tokens_padded),
            lambda: self.programs.model_spec(weights, *model_args[2:], layout),
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
        sample_args = (logits, self._step_input(packed))
        program = self.program_store.get(
            self._key(ProgramKind.SAMPLER, step.shape.sampler_rows),
            lambda: self.programs.sampler_spec(*sample_args, layout),
            layout,
        )
        return program(*sample_args), hidden

    def _run_prompt_logprobs(self, hidden: np.ndarray, ids: np.ndarray) -> tuple:
        args = (self.weights.arrays(), self._put(hidden), self._put(ids))
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
            # Before the forward: saves blocks it may overwrite, loads blocks it reads.
            self.kv_caches = self.host_kv.apply(self.kv_caches, transfers)
        batch = self.input_batch
        if self.lora is not None:
            self.lora.track(scheduler_output, batch.requests)
        batch.update(scheduler_output)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        if not req_ids:
            self._prev_rows = {}
            self._in_flight.append(None)
            return
        num_scheduled = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        spec_lens = None
        if self.speculator is not None:
            proposals = scheduler_output.scheduled_spec_decode_tokens
            spec_lens = self.speculator.write_proposals(batch, req_ids, proposals)
        rows = len(req_ids) + (0 if spec_lens is None else int(spec_lens.sum()))  # logit rows
        total = scheduler_output.total_num_scheduled_tokens
        num_tokens_padded = self.readiness.ready_bucket(total, rows)
        step = self._prepare_inputs(
            req_ids, num_scheduled, num_tokens_padded, scheduler_output, spec_lens
        )
        in_flight = self._launch(req_ids, num_scheduled, step)
        in_flight.spec_lens, in_flight.started = spec_lens, started
        self._in_flight.append(in_flight)

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
        spec = self.speculator
        policy = None if spec is None else spec.policy
        token_ids, logprobs = read_sampled(step, self.input_batch, policy)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
            spec_token_ids=None if spec is None else spec.propose_after(step, self.input_batch),
        )

    # ---- programs --------------------------------------------------------------------
    def program_specs(self) -> dict[ProgramKey, ProgramSpec]:
        """Every program serving may need (xlm.worker.programs): one model program per
        token bucket with the programs that read its outputs (_bucket_specs), and the
        others (_other_specs)."""
        specs: dict[ProgramKey, ProgramSpec] = {}
        pool = None if self.encoder is None else self.encoder.pool
        for bucket in self.buckets.token_buckets:
            arrays = self._prepare_inputs([], [], bucket).arrays
            model_spec = self.programs.model_spec_of(self.weights.arrays(), arrays, pool)
            specs[self._key(ProgramKind.MODEL, bucket)] = model_spec
            specs.update(self._bucket_specs(bucket, arrays, model_spec))
        specs.update(self._other_specs())
        return specs

    def _bucket_specs(
        self, bucket: int, arrays: dict[str, Any], model_spec: ProgramSpec
    ) -> dict[ProgramKey, ProgramSpec]:
        """The samplers a step of this token bucket may run."""
        sampling_of = partial(self.input_batch.sampling_metadata, np.zeros(0, np.intp), step_seed=0)
        return self.programs.sampler_specs(bucket, sampling_of, self.vocab_size)

    def _other_specs(self) -> dict[ProgramKey, ProgramSpec]:
        """The prompt-logprobs program (and a multimodal model's encoder programs)."""
        # The hidden states' dtype: the model's (its first leaf may be an int8 embedding).
        model_config = self.config.model_config
        dtype = resolve_dtype(model_config.dtype, model_config.hf_config)
        specs = self.programs.prompt_logprobs_specs(self.weights.arrays(), self.hidden_size, dtype)
        if self.encoder is not None:  # the encoder, by image count
            specs.update(self.encoder.specs(self.mesh))
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
