"""The model runner: scheduler output -> padded ragged batch -> one jitted step -> tokens.

Shapes come only from buckets: the token count T is padded up to a token bucket and the
request count to min(bucket, max_num_seqs), so XLA compiles one program per bucket, all
during warm-up. Every step's inputs travel to the device in one packed transfer, and the
KV cache is donated to the step so XLA updates it in place.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from xlm import envs
from xlm.config import XlmConfig
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.distributed.mesh import describe_mesh, fetch, put_replicated, replicated
from xlm.engine.output_processor import LogprobsLists
from xlm.logger import init_logger
from xlm.ops.paged_attention import AttentionMetadata
from xlm.worker import sampler as sampler_lib
from xlm.worker.executable_cache import ExecutableCache
from xlm.worker.input_batch import CachedRequestState, InputBatch
from xlm.worker.packing import pack, unpack

logger = init_logger(__name__)


# Prompt positions scored per call of the prompt-logprobs program (one compiled shape).
PROMPT_LOGPROB_ROWS = 128


def executable_cache_dir(config: XlmConfig) -> str | None:
    """Where compiled programs are saved, or None when the cache is off.

    This replaces JAX's persistent compilation cache for the step programs: that cache
    still traces and lowers each program (~1 s each), and on XLA:CPU an executable it
    loaded cannot be serialized again (the reloaded copy fails with "Function ... not
    found"), so the two must not be mixed.
    """
    cache_dir = envs.XLM_COMPILATION_CACHE_DIR
    if not config.compilation_config.enable_compilation_cache or not cache_dir:
        return None
    if config.parallel_config.is_multihost:
        # A multi-process program loaded back from disk gave wrong tokens on XLA:CPU
        # (Gloo); every process compiles until that is understood.
        return None
    return cache_dir


def default_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 1 up to the step's token budget (always included)."""
    buckets, b = [], 1
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_num_batched_tokens)
    return buckets


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
        # None: one device; else the (data, model) mesh the weights and cache live on.
        self.mesh = mesh
        sched, cache = config.scheduler_config, config.cache_config
        self.block_size = cache.block_size
        self.max_model_len = sched.max_model_len
        self.max_num_seqs = sched.max_num_seqs
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.token_buckets = config.compilation_config.token_buckets or default_token_buckets(
            sched.max_num_batched_tokens
        )
        if self.token_buckets[-1] < sched.max_num_batched_tokens:
            raise ValueError(
                f"CompilationConfig.token_buckets={self.token_buckets} must reach "
                f"max_num_batched_tokens={sched.max_num_batched_tokens}"
            )
        self.vocab_size = config.model_config.hf_config.vocab_size
        self.sampler_config = sampler_lib.SamplerConfig()
        self.input_batch = InputBatch(
            self.max_num_seqs, self.max_model_len, self.max_blocks_per_req
        )
        self.graphdef, self.state = nnx.split(model)
        self.num_blocks = num_blocks
        self.kv_caches = model.make_kv_caches(num_blocks, self.block_size, kv_dtype, mesh=mesh)
        # Unseeded requests draw from the engine seed folded with the step count.
        self.step_count = config.model_config.seed << 20
        # The sampler compiles per row bucket, fewer than token buckets (its logits are
        # padded up to the bucket): powers of four up to max_num_seqs.
        self.sampler_buckets = sorted({min(4**i, self.max_num_seqs) for i in range(16)})
        # Programs compiled so far; after warm-up it must not move (a compile is a bug).
        self.num_compilations = 0
        self._programs: dict[tuple[str, Any], Any] = {}
        self._model_fn = jax.jit(self._model_step, static_argnums=(3,), donate_argnums=(1,))
        self._executables = ExecutableCache(
            executable_cache_dir(config),
            # Each process of a multihost engine compiles (and saves) its own programs.
            self._engine_fingerprint(config, num_blocks, kv_dtype)
            + f"{describe_mesh(mesh)}, process {jax.process_index()}",
        )
        self._sample_fn = jax.jit(self._sample_step, static_argnums=(2,))
        self._prompt_logprobs_fn = jax.jit(self._prompt_logprobs_step)

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
        rows = self._sampler_bucket(logits.shape[0])
        logits = jnp.pad(logits, ((0, rows - logits.shape[0]), (0, 0)))
        if self.mesh is not None:
            # Gathered over the vocabulary shards: the sampler runs whole on every device.
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
        if self.mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, replicated(self.mesh))

    @staticmethod
    def _engine_fingerprint(config: XlmConfig, num_blocks: int, kv_dtype: Any) -> str:
        """What besides shapes decides the compiled programs."""
        model = config.model_config
        return repr(
            (
                model.model,
                model.dtype,
                model.hf_config.to_json_string(),
                config.scheduler_config,
                config.cache_config.block_size,
                num_blocks,
                str(jnp.dtype(kv_dtype)),
                config.compilation_config.custom_ops,
                config.parallel_config,
            )
        )

    def _trees(self, kind: str, args: tuple) -> tuple[Any, Any]:
        """Input and output pytree structures of a program (to load it without tracing)."""
        in_tree = jax.tree_util.tree_structure((args, {}))
        if kind == "model":
            out_tree = jax.tree_util.tree_structure((list(self.kv_caches), 0, 0))
        elif kind == "prompt_logprobs":
            out_tree = jax.tree_util.tree_structure((0, 0, 0, 0))
        else:
            out_tree = jax.tree_util.tree_structure(sampler_lib.SamplerOutput(0, 0, 0, 0, 0))
        return in_tree, out_tree

    def _lower(self, kind: str, args: tuple, layout: Any) -> Any:
        if self.mesh is not None:
            # Ops that shard_map their kernels read the mesh while tracing.
            with jax.set_mesh(self.mesh):
                return self._lower_traced(kind, args, layout)
        return self._lower_traced(kind, args, layout)

    def _lower_traced(self, kind: str, args: tuple, layout: Any) -> Any:
        if kind == "prompt_logprobs":
            return self._prompt_logprobs_fn.lower(*args)
        fn = self._model_fn if kind == "model" else self._sample_fn
        return fn.lower(*args, layout)

    def _put(self, value: np.ndarray) -> jax.Array:
        """Host array -> device(s): replicated over the mesh when there is one."""
        return put_replicated(value, self.mesh)

    def _abstract(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        sharding = None if self.mesh is None else replicated(self.mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def _program(self, kind: str, args: tuple, layout: Any) -> Any:
        """The compiled program for these shapes (compiling it is a bug after warm-up)."""
        program = self._programs.get((kind, layout))
        if program is None:
            logger.warning("Compiling a %s program for new shapes during serving.", kind)
            program = self._programs[(kind, layout)] = self._lower(kind, args, layout).compile()
            self.num_compilations += 1
        return program

    # ---- host side -------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.release(req_id, forget=True)
        for req_id in so.preempted_req_ids:
            batch.release(req_id, forget=False)
        for new in so.scheduled_new_reqs:
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), new.sampling_params)
            batch.add(state, list(new.block_ids), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = batch.requests[req_id]
            if cached.resumed_from_preemption[i]:
                if state.slot >= 0:
                    batch.release(req_id, forget=False)
                state.output_token_ids = list(cached.new_token_ids[i])
                batch.add(state, list(cached.new_block_ids[i]), cached.num_computed_tokens[i])
            else:
                batch.append_blocks(state.slot, list(cached.new_block_ids[i]))
                batch.num_computed_tokens[state.slot] = cached.num_computed_tokens[i]

    def _bucket(self, num_tokens: int) -> int:
        for b in self.token_buckets:
            if b >= num_tokens:
                return b
        raise ValueError(
            f"step of {num_tokens} tokens exceeds the largest token bucket {self.token_buckets[-1]}"
        )

    def _sampler_bucket(self, num_rows: int) -> int:
        return next(b for b in self.sampler_buckets if b >= num_rows)

    def _prepare_inputs(
        self, req_ids: list[str], num_scheduled: list[int], num_tokens_padded: int
    ) -> tuple[dict[str, Any], Any, np.ndarray]:
        """Build the padded ragged batch; returns the arrays and which rows sample."""
        batch = self.input_batch
        num_reqs = len(req_ids)
        num_reqs_padded = min(num_tokens_padded, self.max_num_seqs)
        slots = np.fromiter((batch.requests[r].slot for r in req_ids), np.int32, num_reqs)
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
        slot_mapping = np.zeros(num_tokens_padded, dtype=np.int32)  # padding -> null block
        pos = positions[:total]
        slot_mapping[:total] = (
            batch.block_table[token_slots, pos // self.block_size] * self.block_size
            + pos % self.block_size
        )
        seq_lens = np.zeros(num_reqs_padded, dtype=np.int32)
        seq_lens[:num_reqs] = computed + counts
        block_tables = np.zeros((num_reqs_padded, self.max_blocks_per_req), dtype=np.int32)
        block_tables[:num_reqs] = batch.block_table[slots]
        logits_indices = np.zeros(num_reqs_padded, dtype=np.int32)
        logits_indices[:num_reqs] = cu[1 : num_reqs + 1] - 1
        # A request samples when this step computes its last known token.
        samples = seq_lens[:num_reqs] >= batch.num_tokens[slots]
        rows = self._sampler_bucket(num_reqs_padded)
        params = [batch.requests[r].sampling_params for r in req_ids]
        outputs = [batch.requests[r].output_token_ids for r in req_ids]
        prompts = [batch.requests[r].prompt_token_ids for r in req_ids]
        sampling = sampler_lib.build_sampling_metadata(
            params + [None] * (rows - num_reqs),
            outputs + [[]] * (rows - num_reqs),
            prompts + [[]] * (rows - num_reqs),
            rows,
            self.vocab_size,
            self.max_model_len,
            step_seed=self.step_count,
        )
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

    def _run(self, inputs: dict[str, Any], sampling: Any) -> Any:
        packed, layout = pack(inputs)
        model_args = (self.state, self.kv_caches, self._put(packed))
        self.kv_caches, logits, hidden = self._program("model", model_args, layout)(*model_args)
        packed, layout = pack(sampling)
        sample_args = (logits, self._put(packed))
        sampled = self._program("sampler", sample_args, layout)(*sample_args)
        return fetch(sampled), hidden

    def _prompt_logprobs(
        self, req_ids: list[str], num_scheduled: list[int], hidden: jax.Array
    ) -> dict[str, LogprobsLists] | None:
        """Logprobs of the prompt tokens this step computed, for requests that asked."""
        batch = self.input_batch
        rows: list[int] = []
        targets: list[int] = []
        spans: dict[str, tuple[int, int, int]] = {}
        offset = 0
        for req_id, n in zip(req_ids, num_scheduled):
            state = batch.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            computed = int(batch.num_computed_tokens[state.slot])  # before this step
            if k is not None:
                # Positions p in this chunk whose next token is still a prompt token (and
                # not already scored before a preemption).
                start = max(computed, state.num_prompt_logprobs_done)
                stop = min(computed + n, len(state.prompt_token_ids) - 1)
                if stop > start:
                    spans[req_id] = (len(rows), stop - start, k)
                    first_row = offset + start - computed
                    rows.extend(range(first_row, first_row + stop - start))
                    targets.extend(state.prompt_token_ids[start + 1 : stop + 1])
                    state.num_prompt_logprobs_done = stop
            offset += n
        if not rows:
            return None
        chunk = PROMPT_LOGPROB_ROWS
        hidden_rows = fetch(hidden)[rows]
        results = []
        for i in range(0, len(rows), chunk):
            h = np.zeros((chunk, hidden_rows.shape[1]), hidden_rows.dtype)
            ids = np.zeros(chunk, np.int32)
            part = hidden_rows[i : i + chunk]
            h[: len(part)] = part
            ids[: len(part)] = targets[i : i + chunk]
            args = (self.state, self._put(h), self._put(ids))
            results.append(fetch(self._program("prompt_logprobs", args, chunk)(*args)))
        lp, ranks, top_ids, top_lps = (
            np.concatenate(parts)[: len(rows)] for parts in zip(*results)
        )
        out = {}
        for req_id, (first, count, k) in spans.items():
            sl = slice(first, first + count)
            out[req_id] = LogprobsLists.from_sampler(
                targets[sl], lp[sl], ranks[sl], top_ids[sl, :k], top_lps[sl, :k]
            )
        return out

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and return the sampled tokens per request."""
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        num_scheduled = [so.num_scheduled_tokens[r] for r in req_ids]
        inputs, sampling, samples = self._prepare_inputs(
            req_ids, num_scheduled, self._bucket(so.total_num_scheduled_tokens)
        )
        sampled, hidden = self._run(inputs, sampling)
        prompt_logprobs = self._prompt_logprobs(req_ids, num_scheduled, hidden)
        batch = self.input_batch
        token_ids = np.asarray(sampled.sampled_token_ids)
        sampled_token_ids: list[list[int]] = []
        logprobs: list[Any] = []
        any_logprobs = False
        for i, req_id in enumerate(req_ids):
            state = batch.requests[req_id]
            batch.num_computed_tokens[state.slot] += num_scheduled[i]
            if not samples[i]:
                sampled_token_ids.append([])
                logprobs.append(None)
                continue
            token = int(token_ids[i])
            state.output_token_ids.append(token)
            batch.append_token(state.slot, token)
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
            prompt_logprobs=prompt_logprobs,
        )

    def warmup(self) -> None:
        """Compile every bucket's programs before serving, in parallel threads."""
        start = time.perf_counter()
        programs: dict[tuple[str, Any], tuple] = {}
        for bucket in self.token_buckets:
            inputs, sampling, _ = self._prepare_inputs([], [], bucket)
            packed, layout = pack(inputs)
            programs[("model", layout)] = (
                self.state,
                self.kv_caches,
                self._abstract(packed.shape, packed.dtype),
            )
            packed, layout = pack(sampling)
            rows = self._sampler_bucket(min(bucket, self.max_num_seqs))
            logits = self._abstract((rows, self.vocab_size), jnp.float32)
            programs[("sampler", layout)] = (logits, self._abstract(packed.shape, packed.dtype))
        hidden_size = self.config.model_config.hf_config.hidden_size
        dtype = jax.tree_util.tree_leaves(self.state)[0].dtype
        programs[("prompt_logprobs", PROMPT_LOGPROB_ROWS)] = (
            self.state,
            self._abstract((PROMPT_LOGPROB_ROWS, hidden_size), dtype),
            self._abstract((PROMPT_LOGPROB_ROWS,), jnp.int32),
        )
        lowered: dict[tuple[str, Any], Any] = {}
        loaded = 0
        for (kind, layout), args in programs.items():
            if (kind, layout) in self._programs:
                continue
            program = self._executables.load(kind, layout, *self._trees(kind, args))
            if program is not None:
                self._programs[(kind, layout)] = program
                loaded += 1
            else:
                lowered[(kind, layout)] = self._lower(kind, args, layout)
        keys = list(lowered)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = [pool.submit(lowered[k].compile) for k in keys]
            for key, future in zip(
                keys, tqdm(futures, desc="Compiling", disable=envs.XLM_DISABLE_PROGRESS_BARS)
            ):
                self._programs[key] = future.result()
                self._executables.store(*key, self._programs[key])
        self.num_compilations += len(keys) + loaded
        logger.info(
            "Compiled %d programs, loaded %d saved ones, in %.1f s.",
            len(keys),
            loaded,
            time.perf_counter() - start,
        )
