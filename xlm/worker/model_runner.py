"""The model runner: scheduler output -> padded ragged batch -> the step's programs -> tokens.

The runner owns the model state, the KV cache and the jitted step functions. Per-request
state lives in the InputBatch (updated from each SchedulerOutput); which programs exist
and how they are compiled, saved and warmed up is xlm.worker.compilation's; prompt
logprobs are xlm.worker.prompt_logprobs'. Every step's inputs travel to the device in one
packed transfer, and the KV cache is donated to the step so XLA updates it in place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlm.config import XlmConfig
from xlm.core.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from xlm.distributed.mesh import fetch, put_replicated, replicated
from xlm.logger import init_logger
from xlm.ops.paged_attention import AttentionMetadata
from xlm.worker import prompt_logprobs
from xlm.worker import sampler as sampler_lib
from xlm.worker.compilation import (
    Buckets,
    Compiler,
    MeshSpec,
    ProgramKey,
    ProgramKind,
    ProgramSpec,
    engine_fingerprint,
    executable_cache_dir,
)
from xlm.worker.executable_cache import ExecutableCache
from xlm.worker.input_batch import InputBatch
from xlm.worker.packing import pack, unpack
from xlm.worker.prompt_logprobs import PROMPT_LOGPROB_ROWS

logger = init_logger(__name__)


class ModelRunner:
    """Owns the model, the KV cache and the jitted step; turns SchedulerOutputs into tokens."""

    def __init__(
        self,
        config: XlmConfig,
        model: nnx.Module,
        num_blocks: int,
        kv_dtype: jnp.dtype,
        mesh: jax.sharding.Mesh | None = None,
    ) -> None:
        self.config = config
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
        self.sampler_config = sampler_lib.SamplerConfig()
        self.input_batch = InputBatch(
            self.max_num_seqs,
            self.max_model_len,
            self.max_blocks_per_req,
            self.vocab_size,
            len(cache.kv_cache_groups or ()),
        )
        self.graphdef, self.state = nnx.split(model)
        self.num_blocks = num_blocks
        self.kv_caches = model.make_kv_caches(num_blocks, self.block_size, kv_dtype, mesh=mesh)
        # Unseeded requests draw from the engine seed folded with the step count.
        self.step_count = config.model_config.seed << 20
        self._model_fn = jax.jit(self._model_step, static_argnums=(3,), donate_argnums=(1,))
        self._sample_fn = jax.jit(self._sample_step, static_argnums=(2,))
        self._prompt_logprobs_fn = jax.jit(self._prompt_logprobs_step)
        self.compiler = Compiler(
            ExecutableCache(
                executable_cache_dir(config),
                engine_fingerprint(config, num_blocks, kv_dtype, self.mesh),
            )
        )

    @property
    def token_buckets(self) -> list[int]:
        return list(self.buckets.token_buckets)

    @property
    def num_compilations(self) -> int:
        """Programs compiled or loaded so far; after warm-up it must not move."""
        return self.compiler.num_compilations

    # ---- the jitted programs ---------------------------------------------------------
    def _model_step(
        self, state: nnx.State, kv_caches: list[jax.Array], packed: jax.Array, layout: Any
    ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
        """Model forward over the ragged batch: caches, last-token logits, hidden states."""
        inputs = unpack(packed, layout)
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model(inputs["input_ids"], kv_caches, inputs["attn"])
        logits = model.compute_logits(hidden[inputs["logits_indices"]])
        # Pad (not compute) up to the sampler's row bucket, so its program fits every step.
        rows = self.buckets.sampler_bucket(logits.shape[0])
        logits = jnp.pad(logits, ((0, rows - logits.shape[0]), (0, 0)))
        # Under a mesh the logits are gathered over the vocabulary shards: the sampler
        # runs whole on every device.
        logits, hidden = self._replicate((logits, hidden))
        return kv_caches, logits, hidden

    def _prompt_logprobs_step(
        self, state: nnx.State, hidden: jax.Array, next_token_ids: jax.Array
    ) -> tuple[jax.Array, ...]:
        """Logprobs of the next prompt tokens from hidden states [P, H] (plus the top-k)."""
        model = nnx.merge(self.graphdef, state)
        return self._replicate(
            sampler_lib.compute_prompt_logprobs(
                model.compute_logits(hidden), next_token_ids, self.sampler_config.max_num_logprobs
            )
        )

    def _sample_step(self, logits: jax.Array, packed: jax.Array, layout: Any) -> Any:
        """Sample one token per row of logits [R, V] (R: the sampler's row bucket)."""
        return self._replicate(
            sampler_lib.sample(logits, unpack(packed, layout), self.sampler_config)
        )

    def _replicate(self, tree: Any) -> Any:
        """Outputs the host reads: a whole copy on every device (each process reads its own)."""
        if self.device_mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, replicated(self.device_mesh))

    def _put(self, value: np.ndarray) -> jax.Array:
        """Host array -> device(s): replicated over the mesh when there is one."""
        return put_replicated(value, self.device_mesh)

    def _abstract(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        sharding = None if self.device_mesh is None else replicated(self.device_mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    # ---- program specs (what compilation lowers) ---------------------------------------
    def _key(self, kind: ProgramKind, size: int) -> ProgramKey:
        return ProgramKey(kind, size, self.mesh)

    def _model_spec(self, packed: Any, layout: Any) -> ProgramSpec:
        out_tree = jax.tree_util.tree_structure((list(self.kv_caches), 0, 0))
        args = (self.state, self.kv_caches, packed)
        return ProgramSpec(self._model_fn, args, layout, out_tree, self.device_mesh)

    def _sampler_spec(self, logits: Any, packed: Any, layout: Any) -> ProgramSpec:
        out_tree = jax.tree_util.tree_structure(sampler_lib.SamplerOutput(0, 0, 0, 0, 0))
        return ProgramSpec(self._sample_fn, (logits, packed), layout, out_tree, self.device_mesh)

    def _prompt_logprobs_spec(self, hidden: Any, ids: Any) -> ProgramSpec:
        out_tree = jax.tree_util.tree_structure((0, 0, 0, 0))
        args = (self.state, hidden, ids)
        return ProgramSpec(self._prompt_logprobs_fn, args, None, out_tree, self.device_mesh)

    # ---- host side -------------------------------------------------------------------
    def _prepare_inputs(
        self,
        req_ids: list[str],
        num_scheduled: list[int],
        num_tokens_padded: int,
        so: SchedulerOutput | None = None,
    ) -> tuple[dict[str, Any], Any, np.ndarray]:
        """Build the padded ragged batch; returns the arrays and which rows sample."""
        batch = self.input_batch
        num_reqs = len(req_ids)
        num_reqs_padded = self.buckets.rows_for_tokens(num_tokens_padded)
        slots = batch.slots(req_ids)
        counts = np.asarray(num_scheduled, dtype=np.int32)
        total = int(counts.sum())
        cu = np.zeros(num_reqs_padded + 1, dtype=np.int32)
        np.cumsum(counts, out=cu[1 : num_reqs + 1])
        cu[num_reqs + 1 :] = total
        computed = batch.num_computed_tokens[slots]
        req_of_token = np.repeat(np.arange(num_reqs), counts)
        positions = np.zeros(num_tokens_padded, dtype=np.int32)
        positions[:total] = computed[req_of_token] + (np.arange(total) - cu[req_of_token])
        token_slots = slots[req_of_token]
        input_ids = np.zeros(num_tokens_padded, dtype=np.int32)
        input_ids[:total] = batch.token_ids[token_slots, positions[:total]]
        # With KV cache groups the tables carry a leading group axis ([G, ...]).
        tables = batch.block_table
        groups = tables.shape[:-2]
        slot_mapping = np.zeros((*groups, num_tokens_padded), dtype=np.int32)  # pad: null block
        pos = positions[:total]
        slot_mapping[..., :total] = (
            tables[..., token_slots, pos // self.block_size] * self.block_size
            + pos % self.block_size
        )
        seq_lens = np.zeros(num_reqs_padded, dtype=np.int32)
        seq_lens[:num_reqs] = computed + counts
        block_tables = np.zeros((*groups, num_reqs_padded, self.max_blocks_per_req), np.int32)
        block_tables[..., :num_reqs, :] = tables[..., slots, :]
        logits_indices = np.zeros(num_reqs_padded, dtype=np.int32)
        logits_indices[:num_reqs] = cu[1 : num_reqs + 1] - 1
        # A request samples when this step computes its last known token.
        samples = seq_lens[:num_reqs] >= batch.num_tokens[slots]
        rows = self.buckets.sampler_bucket(num_reqs_padded)
        grammar_rows = None
        if so is not None and so.structured_output_request_ids:
            # Structured-output bitmask rows (from the scheduler) by position in this step.
            row_of = {r: i for i, r in enumerate(req_ids)}
            grammar_rows = {
                row_of[r]: so.grammar_bitmask[i]
                for i, r in enumerate(so.structured_output_request_ids)
            }
        sampling = batch.sampling_metadata(slots, rows, self.step_count, grammar_rows)
        self.step_count += 1
        inputs = {
            "input_ids": input_ids,
            "attn": AttentionMetadata(
                positions=positions,
                slot_mapping=slot_mapping,
                query_start_loc=cu,
                seq_lens=seq_lens,
                block_tables=block_tables,
                num_seqs=np.array([num_reqs], dtype=np.int32),
            ),
            "logits_indices": logits_indices,
        }
        return inputs, sampling, samples

    def _run(self, num_tokens_padded: int, inputs: dict[str, Any], sampling: Any) -> Any:
        packed, layout = pack(inputs)
        model_args = (self.state, self.kv_caches, self._put(packed))
        program = self.compiler.get(
            self._key(ProgramKind.MODEL, num_tokens_padded),
            lambda: self._model_spec(model_args[2], layout),
            layout,
        )
        self.kv_caches, logits, hidden = program(*model_args)
        packed, layout = pack(sampling)
        sample_args = (logits, self._put(packed))
        program = self.compiler.get(
            self._key(ProgramKind.SAMPLER, logits.shape[0]),
            lambda: self._sampler_spec(*sample_args, layout),
            layout,
        )
        return fetch(program(*sample_args)), hidden

    def _run_prompt_logprobs(self, hidden: np.ndarray, ids: np.ndarray) -> tuple:
        args = (self.state, self._put(hidden), self._put(ids))
        program = self.compiler.get(
            self._key(ProgramKind.PROMPT_LOGPROBS, PROMPT_LOGPROB_ROWS),
            lambda: self._prompt_logprobs_spec(*args[1:]),
        )
        return fetch(program(*args))

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and return the sampled tokens per request."""
        batch = self.input_batch
        batch.update(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        num_scheduled = [so.num_scheduled_tokens[r] for r in req_ids]
        num_tokens_padded = self.buckets.token_bucket(so.total_num_scheduled_tokens)
        inputs, sampling, samples = self._prepare_inputs(
            req_ids, num_scheduled, num_tokens_padded, so
        )
        sampled, hidden = self._run(num_tokens_padded, inputs, sampling)
        prompt_lps = prompt_logprobs.compute(
            prompt_logprobs.plan(batch, req_ids, num_scheduled), hidden, self._run_prompt_logprobs
        )
        batch.advance(req_ids, num_scheduled)
        token_ids = np.asarray(sampled.sampled_token_ids)
        sampled_token_ids: list[list[int]] = []
        logprobs: list[LogprobsLists | None] = []
        any_logprobs = False
        for i, req_id in enumerate(req_ids):
            state = batch.requests[req_id]
            if not samples[i]:
                sampled_token_ids.append([])
                logprobs.append(None)
                continue
            token = int(token_ids[i])
            batch.append_sampled(state, token)
            sampled_token_ids.append([token])
            num_logprobs = state.sampling_params.logprobs
            if num_logprobs is None:
                logprobs.append(None)
                continue
            any_logprobs = True
            logprobs.append(
                LogprobsLists.from_sampler(
                    [token],
                    sampled.logprobs[i : i + 1],
                    sampled.ranks[i : i + 1],
                    sampled.topk_ids[i : i + 1, :num_logprobs],
                    sampled.topk_logprobs[i : i + 1, :num_logprobs],
                )
            )
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs if any_logprobs else None,
            prompt_logprobs=prompt_lps,
        )

    def program_specs(self) -> dict[ProgramKey, ProgramSpec]:
        """Every program serving may need: one model and one sampler program per token
        bucket (the sampler's rows follow the bucket), and the prompt-logprobs program."""
        specs: dict[ProgramKey, ProgramSpec] = {}
        for bucket in self.buckets.token_buckets:
            inputs, sampling, _ = self._prepare_inputs([], [], bucket)
            packed, layout = pack(inputs)
            packed = self._abstract(packed.shape, packed.dtype)
            specs[self._key(ProgramKind.MODEL, bucket)] = self._model_spec(packed, layout)
            packed, layout = pack(sampling)
            packed = self._abstract(packed.shape, packed.dtype)
            rows = self.buckets.sampler_bucket(self.buckets.rows_for_tokens(bucket))
            logits = self._abstract((rows, self.vocab_size), jnp.float32)
            specs[self._key(ProgramKind.SAMPLER, rows)] = self._sampler_spec(logits, packed, layout)
        hidden_size = self.config.model_config.hf_config.hidden_size
        dtype = jax.tree_util.tree_leaves(self.state)[0].dtype
        specs[self._key(ProgramKind.PROMPT_LOGPROBS, PROMPT_LOGPROB_ROWS)] = (
            self._prompt_logprobs_spec(
                self._abstract((PROMPT_LOGPROB_ROWS, hidden_size), dtype),
                self._abstract((PROMPT_LOGPROB_ROWS,), jnp.int32),
            )
        )
        return specs

    def warmup(self) -> None:
        """Compile (or load) every bucket's programs before serving."""
        self.compiler.warmup(self.program_specs())
