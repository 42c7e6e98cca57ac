"""The model runner: scheduler output -> padded ragged batch -> one jitted step -> tokens.

Shapes come only from buckets: the token count T is padded up to a token bucket and the
request count to min(bucket, max_num_seqs), so XLA compiles one program per bucket, all
during warm-up. Every step's inputs travel to the device in one packed transfer, and the
KV cache is donated to the step so XLA updates it in place.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from xlm import envs
from xlm.config import XlmConfig
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.engine.output_processor import LogprobsLists
from xlm.logger import init_logger
from xlm.ops.paged_attention import AttentionMetadata
from xlm.worker import sampler as sampler_lib
from xlm.worker.input_batch import CachedRequestState, InputBatch
from xlm.worker.packing import pack, unpack

logger = init_logger(__name__)


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
        self, config: XlmConfig, model: nnx.Module, num_blocks: int, kv_dtype: jnp.dtype
    ) -> None:
        self.config = config
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
        self.kv_caches = model.make_kv_caches(num_blocks, self.block_size, kv_dtype)
        # Unseeded requests draw from the engine seed folded with the step count.
        self.step_count = config.model_config.seed << 20
        # Programs traced so far; after warm-up it must not move (a compile is a bug).
        self.num_compilations = 0
        self._step = jax.jit(self._step_impl, static_argnums=(3,), donate_argnums=(1,))

    # ---- the jitted step -------------------------------------------------------------
    def _step_impl(
        self,
        state: nnx.State,
        kv_caches: list[jax.Array],
        packed: jax.Array,
        layout: Any,
    ) -> tuple[list[jax.Array], Any]:
        self.num_compilations += 1  # runs only while tracing
        inputs = unpack(packed, layout)
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model(inputs["input_ids"], kv_caches, inputs["attn"])
        logits = model.compute_logits(hidden[inputs["logits_indices"]])
        sampled = sampler_lib.sample(logits, inputs["sampling"], self.sampler_config)
        return kv_caches, sampled

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

    def _prepare_inputs(
        self, req_ids: list[str], num_scheduled: list[int], num_tokens_padded: int
    ) -> tuple[dict[str, Any], np.ndarray]:
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
        params = [batch.requests[r].sampling_params for r in req_ids]
        outputs = [batch.requests[r].output_token_ids for r in req_ids]
        prompts = [batch.requests[r].prompt_token_ids for r in req_ids]
        sampling = sampler_lib.build_sampling_metadata(
            params + [None] * (num_reqs_padded - num_reqs),
            outputs + [[]] * (num_reqs_padded - num_reqs),
            prompts + [[]] * (num_reqs_padded - num_reqs),
            num_reqs_padded,
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
            "sampling": sampling,
        }
        return inputs, samples

    def _run(self, inputs: dict[str, Any]) -> Any:
        packed, layout = pack(inputs)
        self.kv_caches, sampled = self._step(
            self.state, self.kv_caches, jax.device_put(packed), layout
        )
        return jax.device_get(sampled)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and return the sampled tokens per request."""
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        num_scheduled = [so.num_scheduled_tokens[r] for r in req_ids]
        inputs, samples = self._prepare_inputs(
            req_ids, num_scheduled, self._bucket(so.total_num_scheduled_tokens)
        )
        sampled = self._run(inputs)
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
        )

    def warmup(self) -> None:
        """Compile the step for every token bucket before serving."""
        start = time.perf_counter()
        buckets = tqdm(
            self.token_buckets, desc="Compiling buckets", disable=envs.XLM_DISABLE_PROGRESS_BARS
        )
        for bucket in buckets:
            inputs, _ = self._prepare_inputs([], [], bucket)
            self._run(inputs)
        jax.block_until_ready(self.kv_caches)
        logger.info(
            "Compiled %d step programs in %.1f s.",
            len(self.token_buckets),
            time.perf_counter() - start,
        )
