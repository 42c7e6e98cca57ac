"""Gemma 2 and Gemma 3 (text): Llama-shaped decoders with Gemma's own details.

(1 + w) RMSNorms, the embedding scaled by sqrt(hidden_size), GeGLU MLPs, norms before and
after both the attention and the MLP, `query_pre_attn_scalar` for the attention scale,
sliding-window layers per `layer_types`, attention and final logit soft-capping (Gemma 2),
q/k norms and separate local/global rope bases (Gemma 3).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.models.layers import Attention, GatedMLP, VocabEmbedding, rotary_from_config
from xlm.models.llama import LlamaForCausalLM, head_dim_of, layer_sliding_window
from xlm.ops import AttentionMetadata, RMSNorm, RotaryEmbedding

# Gemma's RMSNorm scales by (1 + w); checkpoints store w.
NORM_OFFSET = 1.0


def _norm(config: Any, size: int, dtype: Any) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, dtype=dtype, weight_offset=NORM_OFFSET)


def layer_type(config: Any, layer_idx: int) -> str:
    """ "sliding_attention" or "full_attention" for one layer."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return types[layer_idx]
    return "sliding_attention" if layer_idx % 2 == 0 else "full_attention"


class Gemma2DecoderLayer(nnx.Module):
    """norm -> attention -> norm, residual add; norm -> GeGLU -> norm, residual add."""

    qk_norm: bool = False

    def __init__(self, config: Any, layer_idx: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        head_dim = head_dim_of(config)
        kind = layer_type(config, layer_idx)
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            self.rotary(config, head_dim, kind),
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm_eps=config.rms_norm_eps if self.qk_norm else None,
            qk_norm_offset=NORM_OFFSET,
            sliding_window=layer_sliding_window(config, layer_idx),
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
            scale=config.query_pre_attn_scalar**-0.5,
            dtype=dtype,
            rngs=rngs,
        )
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            hidden_act=config.hidden_activation,
            dtype=dtype,
            rngs=rngs,
        )
        h = config.hidden_size
        self.input_layernorm = _norm(config, h, dtype)
        self.post_attention_layernorm = _norm(config, h, dtype)
        self.pre_feedforward_layernorm = _norm(config, h, dtype)
        self.post_feedforward_layernorm = _norm(config, h, dtype)

    def rotary(self, config: Any, head_dim: int, kind: str):
        return rotary_from_config(config, head_dim)

    def __call__(
        self,
        positions: jax.Array,
        hidden_states: jax.Array,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, kv_cache = self.self_attn(positions, hidden_states, kv_cache, metadata)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + self.post_feedforward_layernorm(hidden_states), kv_cache


class Gemma2Model(nnx.Module):
    """Scaled embedding, the decoder layers, final (1 + w) norm."""

    def __init__(
        self, config: Any, layer_cls: type[Gemma2DecoderLayer], *, dtype: Any, rngs: nnx.Rngs
    ) -> None:
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs
        )
        self.embed_scale = float(config.hidden_size**0.5)
        self.layers = nnx.List(
            [layer_cls(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_hidden_layers)]
        )
        self.norm = _norm(config, config.hidden_size, dtype)
        # Per layer, its KV cache array when layers share them (None: one array each).
        self.kv_cache_index: tuple[int, ...] | None = None

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """Scaled token embeddings [T, H] (transformers rounds the scale to their dtype)."""
        hidden_states = self.embed_tokens(input_ids)
        return hidden_states * jnp.asarray(self.embed_scale, hidden_states.dtype)

    def __call__(
        self,
        input_ids: jax.Array,
        kv_caches: list[jax.Array],
        metadata: AttentionMetadata,
        inputs_embeds: jax.Array | None = None,
    ) -> tuple[jax.Array, list[jax.Array]]:
        # Given embeddings (a multimodal step's) are already scaled: images' are not.
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.kv_cache_index is not None:  # KV cache groups: layers share cache arrays
            caches = list(kv_caches)
            for layer, j in zip(self.layers, self.kv_cache_index, strict=True):
                hidden_states, caches[j] = layer(
                    metadata.positions, hidden_states, caches[j], metadata
                )
            return self.norm(hidden_states), caches
        new_caches = []
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, kv_cache = layer(metadata.positions, hidden_states, kv_cache, metadata)
            new_caches.append(kv_cache)
        return self.norm(hidden_states), new_caches


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM (tied embeddings; final logits soft-capped when configured)."""

    decoder_layer_cls = Gemma2DecoderLayer
    model_cls = Gemma2Model

    def __init__(self, hf_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(hf_config, dtype=dtype, rngs=rngs)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: jax.Array) -> jax.Array:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma 2 block plus (1 + w) q/k norms; local layers use their own rope base."""

    qk_norm = True

    def rotary(self, config: Any, head_dim: int, kind: str):
        params = getattr(config, "rope_parameters", None) or {}
        if isinstance(params.get(kind), dict):  # transformers 5: one dict per layer type
            return rotary_from_config(config, head_dim, kind)
        if kind == "sliding_attention":  # transformers 4: rope_local_base_freq, no scaling
            base = getattr(config, "rope_local_base_freq", 10000.0)
            return RotaryEmbedding(head_dim, head_dim, config.max_position_embeddings, base)
        return rotary_from_config(config, head_dim)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text-only causal LM (gemma-3-1b and the text model of larger ones)."""

    decoder_layer_cls = Gemma3DecoderLayer
