"""Llama (2, 3, 3.1, 3.2, SmolLM2) and the decoder the Llama-shaped families share.

Qwen2, Qwen3, Mistral and Qwen3-MoE subclass the decoder layer here and change only what
differs (biases, q/k norm, sliding window, the MLP).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlm.core.kv_cache_groups import KVCacheGroupSpec, layer_placement
from xlm.models.layers import (
    TP_AXIS,
    Attention,
    GatedMLP,
    ParallelLMHead,
    VocabEmbedding,
    rotary_from_config,
)
from xlm.models.weights import WeightTarget, default_weight_targets
from xlm.ops import AttentionMetadata, PagedAttention, RMSNorm


def head_dim_of(config: Any) -> int:
    """head_dim from the config when present, else hidden_size / num_attention_heads."""
    head_dim = getattr(config, "head_dim", None)
    return head_dim or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The sliding window of one layer as transformers applies it (layer_types when set)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return None
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm attention + gated MLP block with fused residual adds."""

    qk_norm: bool = False
    fused_qkv: bool = False  # one qkv_proj in the checkpoint (Phi-3)

    def __init__(self, config: Any, layer_idx: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        head_dim = head_dim_of(config)
        qkv_bias, o_bias = self.attention_biases(config)
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim,
            rotary_from_config(config, head_dim),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            fused_qkv=self.fused_qkv,
            qk_norm_eps=config.rms_norm_eps if self.qk_norm else None,
            sliding_window=self.sliding_window(config, layer_idx),
            dtype=dtype,
            rngs=rngs,
        )
        self.mlp = self.make_mlp(config, layer_idx, dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o bias)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return None

    def make_mlp(self, config: Any, layer_idx: int, *, dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
        bias = bool(getattr(config, "mlp_bias", False))
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=bias,
            hidden_act=getattr(config, "hidden_act", "silu"),
            dtype=dtype,
            rngs=rngs,
        )

    def __call__(
        self,
        positions: jax.Array,
        hidden_states: jax.Array,
        residual: jax.Array | None,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states, kv_cache = self.self_attn(positions, hidden_states, kv_cache, metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual, kv_cache


class LlamaModel(nnx.Module):
    """Embedding, the decoder layers (a Python loop), final norm."""

    def __init__(
        self, config: Any, layer_cls: type[LlamaDecoderLayer], *, dtype: Any, rngs: nnx.Rngs
    ) -> None:
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs
        )
        self.layers = nnx.List(
            [layer_cls(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        # Per layer, its KV cache array when layers share them (None: one array each).
        self.kv_cache_index: tuple[int, ...] | None = None

    def __call__(
        self,
        input_ids: jax.Array,
        kv_caches: list[jax.Array],
        metadata: AttentionMetadata,
        inputs_embeds: jax.Array | None = None,
    ) -> tuple[jax.Array, list[jax.Array]]:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden_states, residual = inputs_embeds, None
        if self.kv_cache_index is not None:  # KV cache groups: layers share cache arrays
            caches = list(kv_caches)
            for layer, j in zip(self.layers, self.kv_cache_index, strict=True):
                hidden_states, residual, caches[j] = layer(
                    metadata.positions, hidden_states, residual, caches[j], metadata
                )
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states, caches
        new_caches = []
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual, kv_cache = layer(
                metadata.positions, hidden_states, residual, kv_cache, metadata
            )
            new_caches.append(kv_cache)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, new_caches


class LlamaForCausalLM(nnx.Module):
    """Llama causal LM: the interface every xlm model provides to the runner."""

    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    model_cls: type[nnx.Module] = LlamaModel

    def __init__(self, hf_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        self.model = self.model_cls(hf_config, self.decoder_layer_cls, dtype=dtype, rngs=rngs)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size, hf_config.hidden_size, dtype=dtype, rngs=rngs
            )

    def __call__(
        self,
        input_ids: jax.Array,
        kv_caches: list[jax.Array],
        metadata: AttentionMetadata,
        inputs_embeds: jax.Array | None = None,
    ) -> tuple[jax.Array, list[jax.Array]]:
        """input_ids [T] (or their embeddings [T, H]: a multimodal step's) ->
        (hidden_states [T, H], updated per-layer KV caches)."""
        if inputs_embeds is None:  # text models whose model takes no embeddings (Gemma 2/3)
            return self.model(input_ids, kv_caches, metadata)
        return self.model(input_ids, kv_caches, metadata, inputs_embeds)

    def compute_logits(self, hidden_states: jax.Array) -> jax.Array:
        """hidden_states [N, H] -> logits [N, V] in float32."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.attend(hidden_states)

    def attention_ops(self) -> list[PagedAttention]:
        """The paged attention op of every layer, in layer order (one KV cache each)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_caches, num_kv_heads, head_dim): one cache array per layer, or per layer
        of one KV cache group when groups share arrays (use_kv_cache_groups)."""
        ops = self.attention_ops()
        return self.num_kv_caches(), ops[0].num_kv_heads, ops[0].head_dim

    def num_kv_caches(self) -> int:
        """How many KV cache arrays the model reads (make_kv_caches makes these)."""
        # Families whose decoder is not `self.model` (GPT-2's `transformer`) have no groups.
        index = getattr(getattr(self, "model", None), "kv_cache_index", None)
        return len(self.attention_ops()) if index is None else max(index) + 1

    def use_kv_cache_groups(self, groups: list[KVCacheGroupSpec]) -> None:
        """Read each layer's KV through its group's block table, from the array it shares
        with the same-numbered layer of every other group (xlm.core.kv_cache_groups)."""
        if not hasattr(getattr(self, "model", None), "kv_cache_index"):
            raise NotImplementedError(f"{type(self).__name__} has no KV cache groups")
        ops = self.attention_ops()
        placement = layer_placement(groups)
        for op, (group, _) in zip(ops, placement, strict=True):
            op.kv_group = group
        self.model.kv_cache_index = tuple(j for _, j in placement)

    def sliding_windows(self) -> list[int | None]:
        """Each layer's attention window (None: full attention), for the KV cache manager."""
        return [op.sliding_window for op in self.attention_ops()]

    def make_kv_caches(
        self,
        num_blocks: int,
        block_size: int,
        dtype: Any,
        mesh: Mesh | None = None,
        abstract: bool = False,
    ) -> list[Any]:
        """One zeroed KV cache per layer in the attention op's layout (sharded over heads);
        `abstract`: sharded ShapeDtypeStructs instead (a compile target's, nothing allocated)."""
        ops = self.attention_ops()
        shape = ops[0].kv_cache_shape(num_blocks, block_size, dtype)
        sharding = None
        if mesh is not None:
            spec = PartitionSpec()
            if ops[0].num_kv_heads % mesh.shape[TP_AXIS] == 0:
                spec = PartitionSpec(*ops[0].kv_cache_sharding())
            sharding = NamedSharding(mesh, spec)
        if abstract:
            return [
                jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                for _ in range(self.num_kv_caches())
            ]
        return [jnp.zeros(shape, dtype, device=sharding) for _ in range(self.num_kv_caches())]

    def hf_weight_targets(
        self, name: str, param_shapes: dict[str, tuple[int, ...]]
    ) -> list[WeightTarget]:
        """Where the checkpoint tensor `name` goes (empty: not a parameter of this model)."""
        if self.tie_word_embeddings and name == "lm_head.weight":
            return [WeightTarget.skip()]
        return default_weight_targets(name, param_shapes)
