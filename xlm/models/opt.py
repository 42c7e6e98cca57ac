"""OPT: learned absolute positions (offset by 2), LayerNorm, ReLU MLP, biases everywhere.

`do_layer_norm_before=False` (opt-350m) makes the blocks post-norm; a
`word_embed_proj_dim` narrower than the hidden size adds project_in / project_out around
the decoder. The LM head is tied to the (projected) embedding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.models.layers import (
    Attention,
    Linear,
    ParallelLMHead,
    PositionEmbedding,
    VocabEmbedding,
)
from xlm.models.llama import LlamaForCausalLM
from xlm.models.weights import WeightTarget, default_weight_targets
from xlm.ops import AttentionMetadata, LayerNorm, get_act_fn

# OPT's learned position table has two extra leading rows (a fairseq padding legacy):
# position p reads row p + 2.
POSITION_OFFSET = 2


def _check_affine(config: Any) -> None:
    if not getattr(config, "layer_norm_elementwise_affine", True):
        raise ValueError(
            "OPT with layer_norm_elementwise_affine=False is not supported: allowed True"
        )


class OPTDecoderLayer(nnx.Module):
    """Attention and fc1 -> act -> fc2, each with a residual and a LayerNorm (pre or post)."""

    def __init__(self, config: Any, layer_idx: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        h, heads = config.hidden_size, config.num_attention_heads
        bias = bool(getattr(config, "enable_bias", True))
        self.self_attn = Attention(
            h, heads, heads, h // heads, None, qkv_bias=bias, o_bias=bias, dtype=dtype, rngs=rngs
        )
        self.self_attn_layer_norm = LayerNorm(h, dtype=dtype)
        self.fc1 = Linear(h, config.ffn_dim, bias=bias, parallel="column", dtype=dtype, rngs=rngs)
        self.fc2 = Linear(config.ffn_dim, h, bias=bias, parallel="row", dtype=dtype, rngs=rngs)
        self.final_layer_norm = LayerNorm(h, dtype=dtype)
        self.act_fn = get_act_fn(config.activation_function)
        self.pre_norm = bool(config.do_layer_norm_before)

    def __call__(
        self,
        positions: jax.Array,
        hidden_states: jax.Array,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        residual = hidden_states
        if self.pre_norm:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, kv_cache = self.self_attn(positions, hidden_states, kv_cache, metadata)
        hidden_states = residual + hidden_states
        if not self.pre_norm:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if self.pre_norm:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.act_fn(self.fc1(hidden_states)))
        if not self.pre_norm:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states, kv_cache


class OPTDecoder(nnx.Module):
    """Token and position embeddings, optional projections, layers, final LayerNorm."""

    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        _check_affine(config)
        h, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabEmbedding(config.vocab_size, proj, dtype=dtype, rngs=rngs)
        rows = config.max_position_embeddings + POSITION_OFFSET
        self.embed_positions = PositionEmbedding(rows, h, dtype=dtype, rngs=rngs)
        self.position_offset = POSITION_OFFSET
        if proj != h:
            self.project_in = Linear(proj, h, dtype=dtype, rngs=rngs, quantize=False)
            self.project_out = Linear(h, proj, dtype=dtype, rngs=rngs, quantize=False)
        else:
            self.project_in = self.project_out = None
        self.layers = nnx.List(
            [
                OPTDecoderLayer(config, i, dtype=dtype, rngs=rngs)
                for i in range(config.num_hidden_layers)
            ]
        )
        keep_final = config.do_layer_norm_before and not getattr(
            config, "_remove_final_layer_norm", False
        )
        self.final_layer_norm = LayerNorm(h, dtype=dtype) if keep_final else None

    def __call__(
        self, input_ids: jax.Array, kv_caches: list[jax.Array], metadata: AttentionMetadata
    ) -> tuple[jax.Array, list[jax.Array]]:
        hidden_states = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden_states = self.project_in(hidden_states)
        positions = metadata.positions
        hidden_states = hidden_states + self.embed_positions(positions + self.position_offset)
        new_caches = []
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, kv_cache = layer(positions, hidden_states, kv_cache, metadata)
            new_caches.append(kv_cache)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        # project_out runs in compute_logits: hidden states stay hidden_size wide.
        return hidden_states, new_caches


class _OPTModel(nnx.Module):
    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.decoder = OPTDecoder(config, dtype=dtype, rngs=rngs)


class OPTForCausalLM(LlamaForCausalLM):
    """OPT causal LM; the LM head is the token embedding (tied)."""

    def __init__(self, hf_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        self.model = _OPTModel(hf_config, dtype=dtype, rngs=rngs)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size, hf_config.word_embed_proj_dim, dtype=dtype, rngs=rngs
            )

    def __call__(
        self, input_ids: jax.Array, kv_caches: list[jax.Array], metadata: AttentionMetadata
    ) -> tuple[jax.Array, list[jax.Array]]:
        return self.model.decoder(input_ids, kv_caches, metadata)

    def compute_logits(self, hidden_states: jax.Array) -> jax.Array:
        project_out = self.model.decoder.project_out
        if project_out is not None:
            hidden_states = project_out(hidden_states)
        head = self.model.decoder.embed_tokens if self.lm_head is None else self.lm_head
        return head.attend(hidden_states)

    def attention_ops(self) -> list:
        return [layer.self_attn.attn for layer in self.model.decoder.layers]

    def hf_weight_targets(
        self, name: str, param_shapes: dict[str, tuple[int, ...]]
    ) -> list[WeightTarget]:
        if name.startswith("decoder."):  # original facebook/opt-* checkpoints
            name = "model." + name
        if self.tie_word_embeddings and name == "lm_head.weight":
            return [WeightTarget.skip()]
        name = name.replace(".self_attn.out_proj.", ".self_attn.o_proj.")
        return default_weight_targets(name, param_shapes)
