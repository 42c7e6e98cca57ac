"""The model runner: scheduler output -> padded ragged batch -> the step's programs -> tokens.

The runner owns the model state, the KV cache and the jitted step functions. Per-request
state lives in the InputBatch (updated from each SchedulerOutput) and a step's padded
arrays are built from it by xlm.worker.step_inputs; which programs exist
and how they are compiled, saved and warmed up is xlm.worker.compilation's; prompt
logprobs are xlm.worker.prompt_logprobs'. Every step's inputs travel to the device in one
packed transfer, and the KV cache is donated to the step so XLA updates it in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlm.config import XlmConfig
from xlm.core.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from xlm.distributed.mesh import put_replicated, replicated, to_host
from xlm.logger import init_logger
from xlm.lora.adapter import LoRASpec
from xlm.lora.slots import LoRASlots
from xlm.metrics import startup
from xlm.ops import token_slots
from xlm.worker import pooler, prompt_logprobs, spec_decode
from xlm.worker import sampler as sampler_lib
from xlm.worker.buckets import FEW_ROWS, Buckets
from xlm.worker.compilation import (
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
from xlm.worker.step_inputs import prepare_inputs

logger = init_logger(__name__)


@dataclass
class _StepInFlight:
    """A dispatched step whose results have not reached the host yet."""

    req_ids: list[str]
    samples: np.ndarray  # per request: whether it samples (or is pooled) this step
    sampled: sampler_lib.SamplerOutput | None  # device arrays (None: pooling runner)
    hidden: jax.Array | None  # kept only when prompt logprobs read it
    prompt_plan: prompt_logprobs.PromptLogprobsPlan | None
    pooled: jax.Array | None = None  # pooling runner: [rows, hidden] vectors (device)
    # Sampler rows per request (several with speculative decoding), in order.
    row_counts: np.ndarray | None = None
    # Speculative decoding: proposals verified per request, the step's token bucket and
    # when it was dispatched (the policy times steps by bucket).
    spec_lens: np.ndarray | None = None
    bucket: int = 0
    started: float = 0.0


def _allocate(spec: list[jax.ShapeDtypeStruct], result: Future) -> None:
    """Zeroed arrays of `spec` into `result` (run on a thread)."""
    try:
        result.set_result([jnp.zeros(s.shape, s.dtype, device=s.sharding) for s in spec])
    except BaseException as e:  # out of memory: raised where the cache is first read
        result.set_exception(e)


def _weak(method: Any) -> Any:
    """`method` without a strong reference to its object (see ModelRunner.__init__)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        return ref()(*args)

    call.__name__ = call.__qualname__ = method.__name__  # names the programs (no __wrapped__)
    return call


# The LM head's few-rows tiers: a step whose real logit rows fit one (a prompt's prefill: 1;
# a few decodes in a large bucket: FEW_ROWS) computes that many rows and zeros for the rest.
# For one 59-token prompt on SmolLM2 the 64-row head cost ~25 ms of a ~130 ms first token,
# and the 8-row head ~8 ms where one row streams the same 113 MB in ~4.
LOGIT_ROW_TIERS = (1, FEW_ROWS)


def _logits(model: Any, hidden: jax.Array, num_rows: jax.Array, total: int | None = None) -> Any:
    """LM-head logits [L, V] of the step's gathered rows hidden [L, H], of which the first
    `num_rows` are real: computed on the smallest LOGIT_ROW_TIERS tier below L that holds
    them (zeros past it), or on every row; `lax.cond`s choose at run time."""
    total = hidden.shape[0] if total is None else total
    tiers = [t for t in LOGIT_ROW_TIERS if t < total]
    if not tiers:
        return model.compute_logits(hidden)
    tier = tiers[-1]

    def few(h: jax.Array) -> jax.Array:
        out = _logits(model, h[:tier], num_rows, tier)
        return jnp.pad(out, ((0, total - tier), (0, 0)))

    return jax.lax.cond(num_rows <= tier, few, model.compute_logits, hidden)


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
        proposer: spec_decode.Proposer | None = None,
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
        # A pooling runner's programs are the model (no logits) and the pooler, per bucket.
        self.pooling = config.model_config.is_pooling
        self.sampler_config = sampler_lib.SamplerConfig()
        self.input_batch = InputBatch(
            self.max_num_seqs,
            self.max_model_len,
            self.max_blocks_per_req,
            self.vocab_size,
            len(cache.kv_cache_groups or ()),
        )
        self.graphdef, self.state = nnx.split(model)
        # LoRA on: each step's tokens carry their adapter's device slot; the slots are
        # filled from the host cache (xlm.lora.slots) before a step that needs them.
        lora = config.lora_config
        self.lora_enabled = lora is not None
        self.lora: LoRASlots | None = None
        if lora is not None and not abstract:
            self.lora = LoRASlots(self.state, LoRASpec.of(model, lora.max_lora_rank), lora, mesh)
        self.num_blocks = num_blocks
        # The cache's shapes and shardings now (the program specs need them); the zeroed
        # arrays on a thread, overlapping what start-up does next (writing 1 GiB of zeros
        # takes ~0.4 s on CPU); the first read of `kv_caches` waits for them.
        self._kv_spec = model.make_kv_caches(
            num_blocks, self.block_size, kv_dtype, mesh=mesh, abstract=True
        )
        self._kv_caches: list[Any] = self._kv_spec
        self._kv_allocation: Future | None = None
        if not abstract:
            self._kv_allocation = Future()
            threading.Thread(
                target=_allocate, args=(self._kv_spec, self._kv_allocation), daemon=True
            ).start()
        # Unseeded requests draw from the engine seed folded with the step count.
        self.step_count = config.model_config.seed << 20
        # jit over weak methods: a jitted function holds its Python function from C++,
        # where the garbage collector cannot see the cycle back to this runner, so with
        # bound methods no runner (its programs, weights and cache) was ever freed; a test
        # process that made ~60 engines ran out of memory maps and crashed.
        self._model_fn = jax.jit(_weak(self._model_step), static_argnums=(4,), donate_argnums=(1,))
        self._sample_fn = jax.jit(_weak(self._sample_step), static_argnums=(2,))
        self._prompt_logprobs_fn = jax.jit(_weak(self._prompt_logprobs_step))
        self._pool_fn = jax.jit(_weak(self._pool_step), static_argnums=(2,))
        # Steps dispatched and not yet collected, oldest first (async scheduling keeps one
        # in flight while the next is scheduled; execute_model collects at once).
        self._in_flight: deque[_StepInFlight | None] = deque()
        # The last dispatched step's sampled tokens (device, padded to the largest sampler
        # bucket) and which row each sampling request had: a token the host does not know
        # yet is read from there by the next step's program.
        self._max_rows = self.buckets.sampler_buckets[-1]
        self._prev_sampled = (
            self._abstract((self._max_rows,), jnp.int32)
            if abstract
            else self._put(np.zeros(self._max_rows, np.int32))
        )
        self._prev_rows: dict[str, int] = {}
        # Speculative decoding: proposals after each step (xlm.worker.spec_decode).
        self.spec_config = config.speculative_config
        self.proposer = proposer
        if self.spec_config is not None:
            if proposer is None:
                self.proposer = spec_decode.make_ngram_proposer(self.spec_config)
            self.spec_policy = spec_decode.SpeculationPolicy(
                self.spec_config, self.buckets.token_bucket
            )
        self._startup_programs = "all"
        self.compiler = Compiler(
            ExecutableCache(
                None if abstract else executable_cache_dir(config),
                engine_fingerprint(config, num_blocks, kv_dtype, self.mesh),
            )
        )

    @property
    def token_buckets(self) -> list[int]:
        return list(self.buckets.token_buckets)

    @property
    def num_compilations(self) -> int:
        """Programs compiled or loaded so far (a draft model's included); after warm-up it
        must not move."""
        return sum(c.num_compilations for c in self._compilers())

    def _compilers(self) -> list[Compiler]:
        draft = getattr(self.proposer, "runner", None)
        return [self.compiler] + ([draft.compiler] if draft is not None else [])

    def programs_ready(self) -> tuple[int, int]:
        """(ready, registered) step programs, a draft model's included."""
        compilers = self._compilers()
        return sum(c.num_ready for c in compilers), sum(c.num_registered for c in compilers)

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation; whether every program is ready."""
        return all([c.wait(timeout) for c in self._compilers()])

    def shutdown(self) -> None:
        """Stop background compilation (a draft model's too)."""
        for compiler in self._compilers():
            compiler.shutdown()

    # ---- the jitted programs ---------------------------------------------------------
    def _model_step(
        self,
        state: nnx.State,
        kv_caches: list[jax.Array],
        packed: jax.Array,
        prev_sampled: jax.Array,
        layout: Any,
    ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
        """Model forward over the ragged batch: caches, last-token logits, hidden states.

        Input tokens the host did not know when it built the step (async scheduling: the
        previous step sampled them) are read from that step's sampled tokens on device.
        """
        inputs = unpack(packed, layout)
        src = inputs["prev_src"]
        input_ids = jnp.where(src >= 0, prev_sampled[jnp.maximum(src, 0)], inputs["input_ids"])
        model = nnx.merge(self.graphdef, state)
        with token_slots(inputs.get("lora_slots")):
            hidden, kv_caches = model(input_ids, kv_caches, inputs["attn"])
        if self.pooling:  # no language-model head: the pooler reads the hidden states
            return kv_caches, None, self._replicate(hidden)
        logits = _logits(model, hidden[inputs["logits_indices"]], inputs["num_logit_rows"][0])
        # Pad (not compute) up to the sampler's row bucket, so its program fits every step;
        # the first rows apart for the few-rows sampler (buckets.FEW_ROWS).
        few = self.buckets.few_rows_bucket(logits.shape[0]) or logits.shape[0]
        rows = self.buckets.sampler_bucket(logits.shape[0])
        logits = (jnp.pad(logits, ((0, rows - logits.shape[0]), (0, 0))), logits[:few])
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
        """Sample one token per row of logits [R, V] (R: the sampler's row bucket); the
        token ids are padded to the largest bucket, the shape the next model step reads."""
        out = sampler_lib.sample(logits, unpack(packed, layout), self.sampler_config)
        ids = jnp.pad(out.sampled_token_ids, (0, self._max_rows - logits.shape[0]))
        return self._replicate(dataclasses.replace(out, sampled_token_ids=ids))

    def _pool_step(self, hidden: jax.Array, packed: jax.Array, layout: Any) -> jax.Array:
        """One vector per request row from the step's hidden states (xlm.worker.pooler)."""
        rows = unpack(packed, layout)
        return self._replicate(
            pooler.pool(
                hidden,
                rows["query_start_loc"],
                rows["pooling_type"],
                rows["normalize"],
                rows["dimensions"],
            )
        )

    def _replicate(self, tree: Any) -> Any:
        """Outputs the host reads: a whole copy on every device (each process reads its own)."""
        if self.device_mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, replicated(self.device_mesh))

    @property
    def kv_caches(self) -> list[Any]:
        """The KV cache arrays (waits for their allocation the first time)."""
        if self._kv_allocation is not None:
            self._kv_caches = self._kv_allocation.result()
            self._kv_allocation = None
        return self._kv_caches

    @kv_caches.setter
    def kv_caches(self, value: list[Any]) -> None:
        self._kv_allocation = None
        self._kv_caches = value

    def _put(self, value: np.ndarray) -> jax.Array:
        """Host array -> device(s): replicated over the mesh when there is one."""
        return put_replicated(value, self.device_mesh)

    def _abstract(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        sharding = None if self.device_mesh is None else replicated(self.device_mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    # ---- program specs (what compilation lowers) ---------------------------------------
    def _key(self, kind: ProgramKind, size: int) -> ProgramKey:
        return ProgramKey(kind, size, self.mesh)

    def _model_spec(self, packed: Any, prev_sampled: Any, layout: Any) -> ProgramSpec:
        logits = None if self.pooling else (0, 0)  # all rows, and the few-rows sampler's
        out_tree = jax.tree_util.tree_structure((list(self._kv_spec), logits, 0))
        args = (self.state, self._kv_spec, packed, prev_sampled)
        return ProgramSpec(self._model_fn, args, layout, out_tree, self.device_mesh)

    def _sampler_spec(self, logits: Any, packed: Any, layout: Any) -> ProgramSpec:
        out_tree = jax.tree_util.tree_structure(sampler_lib.SamplerOutput(0, 0, 0, 0, 0, 0))
        return ProgramSpec(self._sample_fn, (logits, packed), layout, out_tree, self.device_mesh)

    def _abstract_pooler_spec(self, model_spec: ProgramSpec, query_start_loc: Any) -> ProgramSpec:
        """The pooler program of a bucket, over the hidden states its model program makes."""
        with contextlib.ExitStack() as stack:
            if self.device_mesh is not None:  # sharded ops trace under their mesh
                stack.enter_context(jax.set_mesh(self.device_mesh))
            _, _, hidden = jax.eval_shape(self._model_fn, *model_spec.args, model_spec.static)
        rows = self._pooling_rows([], query_start_loc)
        packed, layout = pack(rows)
        hidden = self._abstract(hidden.shape, hidden.dtype)
        return self._pooler_spec(hidden, self._abstract(packed.shape, packed.dtype), layout)

    def _pooler_spec(self, hidden: Any, packed: Any, layout: Any) -> ProgramSpec:
        out_tree = jax.tree_util.tree_structure(0)
        return ProgramSpec(self._pool_fn, (hidden, packed), layout, out_tree, self.device_mesh)

    def _pooling_rows(
        self, req_ids: list[str], query_start_loc: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The pooler's per-row inputs: the step's spans and each request's pooling."""
        states = self.input_batch.requests
        params = [states[r].pooling_params for r in req_ids]
        rows = pooler.pooling_metadata(params, len(query_start_loc) - 1, self.hidden_size)
        return {"query_start_loc": query_start_loc, **rows}

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
        spec_lens: np.ndarray | None = None,
    ) -> tuple[dict[str, Any], Any, np.ndarray, np.ndarray]:
        """Build the padded ragged batch (xlm.worker.step_inputs) and count the step."""
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
            self.step_count,
            req_ids,
            num_scheduled,
            num_tokens_padded,
            so,
            spec_lens,
            lora_slots,
        )
        self.step_count += 1
        return out

    def _run_model(self, num_tokens_padded: int, inputs: dict[str, Any]) -> tuple[Any, Any]:
        """Launch the step's model program; its logits (None when pooling) and hidden."""
        packed, layout = pack(inputs)
        model_args = (self.state, self.kv_caches, self._put(packed), self._prev_sampled)
        program = self.compiler.get(
            self._key(ProgramKind.MODEL, num_tokens_padded),
            lambda: self._model_spec(*model_args[2:], layout),
            layout,
        )
        self.kv_caches, logits, hidden = program(*model_args)
        return logits, hidden

    def _run_pooler(self, num_tokens_padded: int, hidden: Any, rows: dict[str, Any]) -> Any:
        """Launch the pooler program over the step's hidden states (device vectors)."""
        packed, layout = pack(rows)
        args = (hidden, self._put(packed))
        program = self.compiler.get(
            self._key(ProgramKind.POOLER, num_tokens_padded),
            lambda: self._pooler_spec(*args, layout),
            layout,
        )
        return program(*args)

    def _run(self, num_tokens_padded: int, inputs: dict[str, Any], sampling: Any) -> Any:
        """Launch the step's model and sampler programs; returns their device outputs
        (the sampler's and the hidden states) without waiting for them."""
        (logits, few_logits), hidden = self._run_model(num_tokens_padded, inputs)
        # The sampler's rows (step_inputs: Buckets.sampler_rows): the step's bucket, or
        # the few-rows bucket, whose logits the model program output apart.
        if sampling.temperature.shape[0] == few_logits.shape[0] < logits.shape[0]:
            logits = few_logits
        packed, layout = pack(sampling)
        sample_args = (logits, self._put(packed))
        program = self.compiler.get(
            self._key(ProgramKind.SAMPLER, logits.shape[0]),
            lambda: self._sampler_spec(*sample_args, layout),
            layout,
        )
        return program(*sample_args), hidden

    def _run_prompt_logprobs(self, hidden: np.ndarray, ids: np.ndarray) -> tuple:
        args = (self.state, self._put(hidden), self._put(ids))
        program = self.compiler.get(
            self._key(ProgramKind.PROMPT_LOGPROBS, PROMPT_LOGPROB_ROWS),
            lambda: self._prompt_logprobs_spec(*args[1:]),
        )
        return to_host(program(*args))

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and return the sampled tokens per request."""
        self.dispatch(so)
        return self.collect()

    def dispatch(self, so: SchedulerOutput) -> None:
        """Apply a SchedulerOutput and launch its step on the device, without waiting.

        `collect` returns the results, oldest step first. A step dispatched before the
        previous one is collected (async scheduling) reads that step's sampled tokens on
        the device where its scheduler counted a token in flight.
        """
        started = time.perf_counter()
        batch = self.input_batch
        if self.lora is not None:
            self._track_adapters(so)
        batch.update(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            self._prev_rows = {}
            self._in_flight.append(None)
            return
        num_scheduled = [so.num_scheduled_tokens[r] for r in req_ids]
        num_tokens_padded = self._ready_bucket(so.total_num_scheduled_tokens)
        spec_lens = self._write_proposals(req_ids, so.scheduled_spec_decode_tokens)
        inputs, sampling, samples, row_counts = self._prepare_inputs(
            req_ids, num_scheduled, num_tokens_padded, so, spec_lens
        )
        if self.pooling:
            _, hidden = self._run_model(num_tokens_padded, inputs)
            rows = self._pooling_rows(req_ids, inputs["attn"].query_start_loc)
            pooled = self._run_pooler(num_tokens_padded, hidden, rows)
            batch.advance(req_ids, num_scheduled)
            self._prev_rows = {}
            self._in_flight.append(_StepInFlight(req_ids, samples, None, None, None, pooled))
            return
        sampled, hidden = self._run(num_tokens_padded, inputs, sampling)
        plan = prompt_logprobs.plan(batch, req_ids, num_scheduled)
        batch.advance(req_ids, num_scheduled)
        self._prev_sampled = sampled.sampled_token_ids
        self._prev_rows = {r: i for i, r in enumerate(req_ids) if samples[i]}
        self._in_flight.append(
            _StepInFlight(
                req_ids,
                samples,
                sampled,
                hidden if plan.rows else None,
                plan,
                None,
                row_counts,
                spec_lens,
                num_tokens_padded,
                started,
            )
        )

    def _track_adapters(self, so: SchedulerOutput) -> None:
        """Count the live requests of each adapter (one in use is never dropped)."""
        states = self.input_batch.requests
        for req_id in so.finished_req_ids:
            state = states.get(req_id)
            if state is not None and state.lora_request is not None:
                self.lora.release(state.lora_request.lora_int_id)
        for new in so.scheduled_new_reqs:
            if new.lora_request is not None:
                self.lora.acquire(new.lora_request)

    def _write_proposals(
        self, req_ids: list[str], proposals: dict[str, list[int]]
    ) -> np.ndarray | None:
        """Put each request's scheduled proposals in its token row past its known tokens
        (where step_inputs reads them); their counts, or None without any."""
        if not proposals:
            return None
        batch = self.input_batch
        spec_lens = np.zeros(len(req_ids), np.int32)
        for i, req_id in enumerate(req_ids):
            tokens = proposals.get(req_id)
            if tokens:
                slot = batch.requests[req_id].slot
                n = batch.num_tokens[slot]
                batch.token_ids[slot, n : n + len(tokens)] = tokens
                spec_lens[i] = len(tokens)
        return spec_lens

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest dispatched step; record and return its sampled tokens."""
        step = self._in_flight.popleft()
        if step is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if step.pooled is not None:
            return self._collect_pooled(step)
        batch = self.input_batch
        sampled = to_host(step.sampled)
        prompt_lps = prompt_logprobs.compute(
            step.prompt_plan, step.hidden, self._run_prompt_logprobs
        )
        token_ids = np.asarray(sampled.sampled_token_ids)
        accepted = np.asarray(sampled.accepted)
        sampled_token_ids: list[list[int]] = []
        logprobs: list[LogprobsLists | None] = []
        any_logprobs = False
        row_counts = step.row_counts
        row = 0
        for i, req_id in enumerate(step.req_ids):
            first = row
            row += 1 if row_counts is None else int(row_counts[i])
            if not step.samples[i]:
                sampled_token_ids.append([])
                logprobs.append(None)
                continue
            # Accepted proposals, then the first row's own token that was not one (the
            # correction, or the bonus token after all were accepted).
            last = first
            while last < row - 1 and accepted[last]:
                last += 1
            tokens = token_ids[first : last + 1].tolist()
            sampled_token_ids.append(tokens)
            state = batch.requests.get(req_id)
            if step.spec_lens is not None and step.spec_lens[i] and state is not None:
                self.spec_policy.record_verification(state, int(step.spec_lens[i]), last - first)
            # Finished (forgotten) or preempted since the dispatch: the scheduler decides;
            # a resumed request gets its outputs anew.
            if state is not None and state.slot >= 0:
                for token in tokens:
                    batch.append_sampled(state, token)
            num_logprobs = state.sampling_params.logprobs if state is not None else None
            if num_logprobs is None:
                logprobs.append(None)
                continue
            any_logprobs = True
            end = last + 1
            logprobs.append(
                LogprobsLists.from_sampler(
                    tokens,
                    sampled.logprobs[first:end],
                    sampled.ranks[first:end],
                    sampled.topk_ids[first:end, :num_logprobs],
                    sampled.topk_logprobs[first:end, :num_logprobs],
                )
            )
        spec_token_ids = None
        if self.proposer is not None:
            # Synchronous steps (speculation turns async scheduling off): dispatch to here
            # is the step's time.
            self.spec_policy.record_step(step.bucket, time.perf_counter() - step.started)
            spec_token_ids = spec_decode.propose_for_batch(
                self.proposer,
                self.spec_policy,
                self.spec_config,
                batch,
                [r if step.samples[i] else "" for i, r in enumerate(step.req_ids)],
            )
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs if any_logprobs else None,
            prompt_logprobs=prompt_lps,
            spec_token_ids=spec_token_ids,
        )

    def _collect_pooled(self, step: _StepInFlight) -> ModelRunnerOutput:
        """The vectors of the requests whose prompts this step completed."""
        vectors = np.asarray(to_host(step.pooled))
        states = self.input_batch.requests
        pooled: list[Any] = []
        for i, req_id in enumerate(step.req_ids):
            state = states.get(req_id)
            if not step.samples[i] or state is None:
                pooled.append(None)
                continue
            pooled.append(pooler.finish_vector(vectors[i].copy(), state.pooling_params))
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=[[] for _ in step.req_ids],
            pooler_output=pooled,
        )

    def program_specs(self) -> dict[ProgramKey, ProgramSpec]:
        """Every program serving may need: one model and one sampler program per token
        bucket (the sampler's rows follow the bucket), and the prompt-logprobs program."""
        specs: dict[ProgramKey, ProgramSpec] = {}
        for bucket in self.buckets.token_buckets:
            inputs, _, _, _ = self._prepare_inputs([], [], bucket)
            packed, layout = pack(inputs)
            packed = self._abstract(packed.shape, packed.dtype)
            prev_sampled = self._abstract((self._max_rows,), jnp.int32)
            model_spec = self._model_spec(packed, prev_sampled, layout)
            specs[self._key(ProgramKind.MODEL, bucket)] = model_spec
            if self.pooling:
                specs[self._key(ProgramKind.POOLER, bucket)] = self._abstract_pooler_spec(
                    model_spec, inputs["attn"].query_start_loc
                )
                continue
            for rows in self.buckets.sampler_buckets_for_tokens(bucket):
                sampling = self.input_batch.sampling_metadata(np.zeros(0, np.intp), rows, 0)
                packed, layout = pack(sampling)
                packed = self._abstract(packed.shape, packed.dtype)
                logits = self._abstract((rows, self.vocab_size), jnp.float32)
                spec = self._sampler_spec(logits, packed, layout)
                specs[self._key(ProgramKind.SAMPLER, rows)] = spec
        if self.pooling:  # no sampler, no prompt logprobs: the pooler replaces them
            return specs
        hidden_size = self.hidden_size
        dtype = jax.tree_util.tree_leaves(self.state)[0].dtype
        specs[self._key(ProgramKind.PROMPT_LOGPROBS, PROMPT_LOGPROB_ROWS)] = (
            self._prompt_logprobs_spec(
                self._abstract((PROMPT_LOGPROB_ROWS, hidden_size), dtype),
                self._abstract((PROMPT_LOGPROB_ROWS,), jnp.int32),
            )
        )
        return specs

    # ---- which programs are ready -----------------------------------------------------
    def _bucket_keys(self, bucket: int) -> list[ProgramKey]:
        """The programs a step of this token bucket runs (the model and its sampler, or
        its pooler)."""
        if self.pooling:
            return [self._key(ProgramKind.MODEL, bucket), self._key(ProgramKind.POOLER, bucket)]
        rows = self.buckets.sampler_buckets_for_tokens(bucket)
        samplers = [self._key(ProgramKind.SAMPLER, r) for r in rows]
        return [self._key(ProgramKind.MODEL, bucket), *samplers]

    def _ready_bucket(self, num_tokens: int) -> int:
        """The token bucket a step of `num_tokens` runs in: its own when its programs are
        ready, else the next larger ready one (more padding, the same tokens out) while
        its own moves to the front of the background queue; when none larger is ready,
        its own is made ready now (the first step of `startup_programs="first-use"`)."""
        exact = self.buckets.token_bucket(num_tokens)
        compiler = self.compiler
        if compiler.all_ready:
            return exact
        wanted = self._bucket_keys(exact)
        ready = [
            b
            for b in self.buckets.token_buckets
            if b >= exact and all(compiler.is_ready(k) for k in self._bucket_keys(b))
        ]
        if ready and ready[0] != exact:
            compiler.prefer(wanted)
        # The chosen bucket's programs at once: saved ones load in parallel, the others
        # compile (only when no bucket was ready); in memory already, nothing to do.
        compiler.require(self._bucket_keys(ready[0] if ready else exact))
        if self._startup_programs != "used":  # after the first step's programs (once)
            compiler.start_background(self._background_order())
        return ready[0] if ready else exact

    def _background_order(self) -> list[ProgramKey]:
        """Smallest token bucket first, each with its sampler (or pooler): every model
        program compiles in about the same time, and a missing small bucket costs the
        most (a decode step padded from 1 token to 2048 runs ~70x longer on CPU:
        docs/engine.md, "Start-up"); the compiler then takes the rest (prompt logprobs)."""
        return [k for b in self.buckets.token_buckets for k in self._bucket_keys(b)]

    def warmup(self, startup_programs: str = "all") -> None:
        """Make programs ready before serving: every one ("all"), the largest token
        bucket's with the rest compiled in the background ("largest"), or none until the
        first step, whose bucket is compiled then and the rest in the background
        ("first-use") or each when a step first needs it ("used")."""
        draft = getattr(self.proposer, "runner", None)
        if draft is not None:
            draft.warmup(startup_programs)
        specs = self.program_specs()
        self._startup_programs = startup_programs
        if startup_programs == "all":
            self.compiler.warmup(specs)
        else:
            self.compiler.register(specs)
            if startup_programs == "largest":
                self.compiler.require(self._bucket_keys(self.buckets.token_buckets[-1]))
                self.compiler.start_background(self._background_order())
        startup.note("programs", self.compiler.summary())
