"""The step's program bodies and their ProgramSpecs, with no host state.

StepPrograms holds what the programs close over (the model's graphdef, the buckets, the
mesh, the sampler's config, the KV cache's spec); the weights, caches and per-step arrays
are their arguments. The runner asks compilation (xlm.worker.compilation) for a program by
key and hands it one of the specs built here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm import platforms
from xlm.distributed.mesh import replicated, replicated_shape
from xlm.ops import token_slots
from xlm.worker import pooler
from xlm.worker import sampler as sampler_lib
from xlm.worker.buckets import LOGIT_ROW_TIERS, Buckets
from xlm.worker.compilation import MeshSpec, ProgramKey, ProgramKind, ProgramSpec
from xlm.worker.packing import pack, unpack
from xlm.worker.prompt_logprobs import PROMPT_LOGPROB_ROWS


def weakly_bound(method: Any) -> Any:
    """`method` without a strong reference to its object: a jitted function holds its
    Python function from C++, where the garbage collector cannot see a cycle back to the
    object, so a jitted bound method keeps its object (and all it holds) alive for good."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        return ref()(*args)

    call.__name__ = call.__qualname__ = method.__name__  # names the programs (no __wrapped__)
    return call


def lm_head_logits(
    model: Any, hidden: jax.Array, num_rows: jax.Array, total: int | None = None
) -> Any:
    """LM-head logits [L, V] of the step's gathered rows hidden [L, H], of which the first
    `num_rows` are real: computed on the smallest LOGIT_ROW_TIERS tier below L that holds
    them (zeros past it), or on every row; `lax.cond`s choose at run time."""
    total = hidden.shape[0] if total is None else total
    tiers = [t for t in LOGIT_ROW_TIERS if t < total]
    if not tiers:
        return model.compute_logits(hidden)
    tier = tiers[-1]

    def few(h: jax.Array) -> jax.Array:
        out = lm_head_logits(model, h[:tier], num_rows, tier)
        return jnp.pad(out, ((0, total - tier), (0, 0)))

    return jax.lax.cond(num_rows <= tier, few, model.compute_logits, hidden)


class Weights:
    """The model's weights as the step programs take them: a flat list of arrays.

    Called with the nnx.State itself, a compiled program has jax flatten every Variable in
    Python on every call (3.4 ms against 0.4 ms a call for a 32-layer model on the 2-core
    dev CPU). The Variables are updated in place (sleep mode, weight updates, LoRA slots),
    so `arrays()` reads their values at each call; the programs rebuild the State from
    them while tracing (`state`)."""

    def __init__(self, state: nnx.State) -> None:
        self.treedef = jax.tree_util.tree_structure(state)
        is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        self.variables = jax.tree_util.tree_leaves(state, is_leaf=is_variable)
        if len(self.variables) != self.treedef.num_leaves:  # a Variable of several leaves
            raise ValueError("every weight Variable must hold one array")
        # `get_value` copies through jax.tree.map and checks for refs and hooks: 12 us a
        # Variable, 3.0 ms a step for SmolLM2's 242 (the 2-core dev CPU), against 0.3 us for
        # the raw value, which is the value of a Variable that holds a plain array and has
        # no read hook (every one xlm makes; any other keeps get_value).
        self._getters = [
            v.get_raw_value
            if isinstance(v.get_raw_value(), jax.Array)
            and not nnx.variablelib.is_array_ref(v.get_raw_value())
            and "on_get_value" not in v.get_metadata()
            else v.get_value
            for v in self.variables
        ]

    def arrays(self) -> list[Any]:
        return [get() for get in self._getters]

    def state(self, arrays: list[Any]) -> nnx.State:
        return jax.tree_util.tree_unflatten(self.treedef, arrays)


class StepPrograms:
    """The jitted model, sampler, prompt-logprobs and pooler programs and their specs."""

    def __init__(
        self,
        graphdef: Any,
        weights: Weights,
        buckets: Buckets,
        kv_spec: list[Any],
        mesh: jax.sharding.Mesh | None,
        pooling: bool,
    ) -> None:
        self.graphdef = graphdef
        self.weights = weights
        self.buckets = buckets
        self.kv_spec = kv_spec
        self.mesh = mesh
        self.mesh_spec = MeshSpec.of(mesh)
        # A pooling model's step has no language-model head: the pooler reads its hidden.
        self.pooling = pooling
        self.sampler_config = sampler_lib.SamplerConfig()
        # Sampled tokens are padded to the largest sampler bucket: the next step reads them.
        self.max_rows = buckets.sampler_buckets[-1]
        # Weakly bound, so that these jitted functions do not keep their runner alive; with
        # the XLA options of the platform they compile for (CUDA: graphs, xlm/platforms/cuda.py).
        jit = functools.partial(
            jax.jit, compiler_options=platforms.current_platform.compiler_options() or None
        )
        self.model_fn = jit(
            weakly_bound(self._model_step), static_argnums=(5,), donate_argnums=(1,)
        )
        self.sample_fn = jit(weakly_bound(self._sample_step), static_argnums=(2,))
        self.prompt_logprobs_fn = jit(weakly_bound(self._prompt_logprobs_step))
        self.pool_fn = jit(weakly_bound(self._pool_step), static_argnums=(2,))

    # ---- program bodies ----------------------------------------------------------------
    def _model_step(
        self,
        weights: list[jax.Array],
        kv_caches: list[jax.Array],
        packed: jax.Array,
        prev_sampled: jax.Array,
        mm_pool: jax.Array | None,
        layout: Any,
    ) -> tuple[list[jax.Array], Any, jax.Array]:
        """Model forward over the ragged batch: caches, last-token logits, hidden states.

        Input tokens the host did not know when it built the step (async scheduling: the
        previous step sampled them) are read from that step's sampled tokens on device.
        A multimodal model's image placeholder tokens take their encoder embeddings from
        the encoder cache's pool (`mm_rows`: each token's pool row, 0 for none).
        """
        inputs = unpack(packed, layout)
        src = inputs["prev_src"]
        input_ids = jnp.where(src >= 0, prev_sampled[jnp.maximum(src, 0)], inputs["input_ids"])
        model = nnx.merge(self.graphdef, self.weights.state(weights))
        embeds = None
        if mm_pool is not None:
            rows = inputs["mm_rows"]
            embeds = model.embed_input_ids(input_ids)
            embeds = jnp.where((rows > 0)[:, None], mm_pool[rows].astype(embeds.dtype), embeds)
        with token_slots(inputs.get("lora_slots")):
            if embeds is None:
                hidden, kv_caches = model(input_ids, kv_caches, inputs["attn"])
            else:
                hidden, kv_caches = model(input_ids, kv_caches, inputs["attn"], embeds)
        if self.pooling:
            head = getattr(model, "pooler_head", None)  # a classifier's label logits
            hidden = hidden if head is None else head(hidden)
            return kv_caches, None, self._replicate(hidden)
        logits = lm_head_logits(
            model, hidden[inputs["logits_indices"]], inputs["num_logit_rows"][0]
        )
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
        self, weights: list[jax.Array], hidden: jax.Array, next_token_ids: jax.Array
    ) -> tuple[jax.Array, ...]:
        """Logprobs of the next prompt tokens from hidden states [P, H] (plus the top-k)."""
        model = nnx.merge(self.graphdef, self.weights.state(weights))
        return self._replicate(
            sampler_lib.compute_prompt_logprobs(
                model.compute_logits(hidden), next_token_ids, self.sampler_config.max_num_logprobs
            )
        )

    def _sample_step(self, logits: jax.Array, packed: jax.Array, layout: Any) -> Any:
        """Sample one token per row of logits [R, V] (R: the sampler's row bucket); the
        token ids are padded to the largest bucket, the shape the next model step reads."""
        out = sampler_lib.sample(logits, unpack(packed, layout), self.sampler_config)
        ids = jnp.pad(out.sampled_token_ids, (0, self.max_rows - logits.shape[0]))
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
        if self.mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, replicated(self.mesh))

    # ---- specs (what compilation lowers) -------------------------------------------------
    def key(self, kind: ProgramKind, size: int) -> ProgramKey:
        return ProgramKey(kind, size, self.mesh_spec)

    def shape(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        """An argument's shape, dtype and (replicated) sharding, to lower with."""
        return replicated_shape(shape, dtype, self.mesh)

    def model_spec_of(self, weights: Any, arrays: dict[str, Any], mm_pool: Any) -> ProgramSpec:
        """The model program of a step whose host arrays are shaped as `arrays`."""
        packed, layout = pack(arrays)
        packed = self.shape(packed.shape, packed.dtype)
        prev_sampled = self.shape((self.max_rows,), jnp.int32)
        return self.model_spec(weights, packed, prev_sampled, mm_pool, layout)

    def sampler_specs(
        self, bucket: int, sampling_of: Any, vocab_size: int
    ) -> dict[ProgramKey, ProgramSpec]:
        """The samplers a step of this token bucket may run (its rows follow the bucket);
        `sampling_of(rows)`: the sampler's host arrays for that many rows."""
        specs = {}
        for rows in self.buckets.sampler_buckets_for_tokens(bucket):
            packed, layout = pack(sampling_of(rows))
            packed = self.shape(packed.shape, packed.dtype)
            logits = self.shape((rows, vocab_size), jnp.float32)
            specs[self.key(ProgramKind.SAMPLER, rows)] = self.sampler_spec(logits, packed, layout)
        return specs

    def prompt_logprobs_specs(
        self, weights: Any, hidden_size: int, dtype: Any
    ) -> dict[ProgramKey, ProgramSpec]:
        """The prompt-logprobs program over hidden states of the model's `dtype`."""
        hidden = self.shape((PROMPT_LOGPROB_ROWS, hidden_size), dtype)
        ids = self.shape((PROMPT_LOGPROB_ROWS,), jnp.int32)
        key = self.key(ProgramKind.PROMPT_LOGPROBS, PROMPT_LOGPROB_ROWS)
        return {key: self.prompt_logprobs_spec(weights, hidden, ids)}

    def pooler_specs(
        self, bucket: int, rows: dict[str, Any], model_spec: ProgramSpec
    ) -> dict[ProgramKey, ProgramSpec]:
        """The bucket's pooler over the hidden states its model program makes; `rows`:
        the pooler's host arrays."""
        packed, layout = pack(rows)
        hidden = self.hidden_of(model_spec)
        hidden = self.shape(hidden.shape, hidden.dtype)
        spec = self.pooler_spec(hidden, self.shape(packed.shape, packed.dtype), layout)
        return {self.key(ProgramKind.POOLER, bucket): spec}

    def model_spec(
        self, weights: Any, packed: Any, prev_sampled: Any, mm_pool: Any, layout: Any
    ) -> ProgramSpec:
        logits = None if self.pooling else (0, 0)  # all rows, and the few-rows sampler's
        out_tree = jax.tree_util.tree_structure((list(self.kv_spec), logits, 0))
        args = (weights, self.kv_spec, packed, prev_sampled, mm_pool)
        return ProgramSpec(self.model_fn, args, layout, out_tree, self.mesh)

    def sampler_spec(self, logits: Any, packed: Any, layout: Any) -> ProgramSpec:
        out_tree = jax.tree_util.tree_structure(sampler_lib.SamplerOutput(0, 0, 0, 0, 0, 0))
        return ProgramSpec(self.sample_fn, (logits, packed), layout, out_tree, self.mesh)

    def prompt_logprobs_spec(self, weights: Any, hidden: Any, ids: Any) -> ProgramSpec:
        out_tree = jax.tree_util.tree_structure((0, 0, 0, 0))
        args = (weights, hidden, ids)
        return ProgramSpec(self.prompt_logprobs_fn, args, None, out_tree, self.mesh)

    def pooler_spec(self, hidden: Any, packed: Any, layout: Any) -> ProgramSpec:
        out_tree = jax.tree_util.tree_structure(0)
        return ProgramSpec(self.pool_fn, (hidden, packed), layout, out_tree, self.mesh)

    def hidden_of(self, model_spec: ProgramSpec) -> jax.ShapeDtypeStruct:
        """The hidden states a model program makes (shape and dtype, not computed)."""
        with contextlib.ExitStack() as stack:
            if self.mesh is not None:  # sharded ops trace under their mesh
                stack.enter_context(jax.set_mesh(self.mesh))
            _, _, hidden = jax.eval_shape(self.model_fn, *model_spec.args, model_spec.static)
        return hidden
