"""Qwen3-MoE: Qwen3 attention with top-k routed experts on the sparse layers.

Experts run as a sort-based grouped matmul: each (token, expert) assignment is sorted by
expert and `jax.lax.ragged_dot` multiplies each expert's contiguous group, so the work is
T * top_k rows instead of T * num_experts.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.distributed.tensor_parallel import check_split, tp_size
from xlm.models.layers import TP_AXIS, GatedMLP, Linear, gated_activation, param, unloaded
from xlm.models.llama import LlamaForCausalLM
from xlm.models.qwen3 import Qwen3DecoderLayer
from xlm.models.weights import WeightTarget, column_part
from xlm.ops import SiluAndMul


class SparseMoeBlock(nnx.Module):
    """Softmax router, top-k experts (optionally renormalized), weighted sum of outputs."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        dtype: Any,
        rngs: nnx.Rngs,
    ) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = bool(norm_topk_prob)
        self.gate = Linear(
            hidden, self.num_experts, dtype=dtype, rngs=rngs, lora=False, quantize=False
        )
        # Tensor split of every expert (not expert parallelism): each device holds a slice
        # of every expert's intermediate width, so routing skew never unbalances devices
        # and the grouped matmuls keep one shape; down_proj's partial sums are all-reduced.
        self.shards = tp_size()
        check_split("moe_intermediate_size", inter, self.shards)
        # gate_up [E, hidden, 2 * inter] (gate columns, then up; per shard under TP);
        # down [E, inter, hidden].
        shape = (self.num_experts, hidden, 2 * inter)
        self.gate_up_proj = param(
            unloaded(shape, dtype),
            (None, None, TP_AXIS),
            fused_shards=(2, self.shards),
        )
        shape = (self.num_experts, inter, hidden)
        self.down_proj = param(
            unloaded(shape, dtype),
            (None, TP_AXIS, None),
        )
        self.act_fn = SiluAndMul()

    def __call__(self, x: jax.Array) -> jax.Array:
        num_tokens = x.shape[0]
        router_logits = self.gate(x).astype(jnp.float32)
        probs = jax.nn.softmax(router_logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        flat_experts = experts.reshape(-1)
        order = jnp.argsort(flat_experts, stable=True)
        group_sizes = jnp.bincount(flat_experts, length=self.num_experts).astype(jnp.int32)
        rows = x[order // self.top_k]  # [T * k, H], grouped by expert
        h = jax.lax.ragged_dot(rows, self.gate_up_proj[...], group_sizes)
        h = gated_activation(self.act_fn, h, self.shards)
        h = jax.lax.ragged_dot(h, self.down_proj[...], group_sizes)
        out = h[jnp.argsort(order)].reshape(num_tokens, self.top_k, -1)
        return jnp.einsum("tkh,tk->th", out.astype(jnp.float32), weights).astype(x.dtype)


class Qwen3MoeSparseMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's experts: moe_intermediate_size wide, renormalized when norm_topk_prob."""

    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        super().__init__(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            dtype=dtype,
            rngs=rngs,
        )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3 block whose MLP is sparse on layers HF makes sparse."""

    def make_mlp(self, config: Any, layer_idx: int, *, dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
        mlp_only = getattr(config, "mlp_only_layers", None) or []
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = (
            layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % step == 0
        )
        if sparse:
            return Qwen3MoeSparseMoeBlock(config, dtype=dtype, rngs=rngs)
        return GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)


_PER_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)")


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE causal LM."""

    decoder_layer_cls = Qwen3MoeDecoderLayer

    def hf_weight_targets(
        self, name: str, param_shapes: dict[str, tuple[int, ...]]
    ) -> list[WeightTarget]:
        # Hub checkpoints store one tensor per expert; transformers 5 may save them fused.
        if m := _PER_EXPERT.fullmatch(name):
            mlp, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            if proj == "down_proj":
                return [WeightTarget(f"{mlp}.down_proj", (expert,), transpose=True)]
            path = f"{mlp}.gate_up_proj"
            cols = column_part(param_shapes[path][1:], int(proj == "up_proj"), 2)
            return [WeightTarget(path, (expert, *cols), transpose=True)]
        if m := _FUSED_EXPERTS.fullmatch(name):
            # [E, out, in] per expert -> [E, in, out]
            return [WeightTarget(f"{m.group(1)}.{m.group(2)}", transpose=True)]
        return super().hf_weight_targets(name, param_shapes)
