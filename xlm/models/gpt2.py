"""GPT-2: learned absolute positions, pre-LayerNorm blocks, GELU-tanh MLP, fused c_attn.

GPT-2 checkpoints store `Conv1D` weights already as [in, out], the layout of xlm's
kernels, so they load without a transpose.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.models.layers import Attention, Linear, PositionEmbedding, VocabEmbedding
from xlm.models.llama import LlamaForCausalLM
from xlm.models.weights import WeightTarget
from xlm.ops import AttentionMetadata, LayerNorm, get_act_fn

# Buffers of old checkpoints (the causal mask), never loaded.
_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2MLP(nnx.Module):
    def __init__(self, hidden: int, inner: int, act: str, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.c_fc = Linear(hidden, inner, bias=True, parallel="column", dtype=dtype, rngs=rngs)
        self.c_proj = Linear(inner, hidden, bias=True, parallel="row", dtype=dtype, rngs=rngs)
        self.act_fn = get_act_fn(act)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(self.act_fn(self.c_fc(x)))


class GPT2Block(nnx.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: Any, layer_idx: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        h, heads = config.hidden_size, config.num_attention_heads
        head_dim = h // heads
        scale = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(h, eps, dtype=dtype)
        # The fused qkv is c_attn; the output projection is c_proj (renamed on load).
        self.attn = Attention(
            h,
            heads,
            heads,
            head_dim,
            None,
            qkv_bias=True,
            o_bias=True,
            fused_qkv=True,
            scale=scale,
            dtype=dtype,
            rngs=rngs,
        )
        self.ln_2 = LayerNorm(h, eps, dtype=dtype)
        inner = config.n_inner or 4 * h
        self.mlp = GPT2MLP(h, inner, config.activation_function, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        positions: jax.Array,
        hidden_states: jax.Array,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        attn_out, kv_cache = self.attn(positions, self.ln_1(hidden_states), kv_cache, metadata)
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.ln_2(hidden_states)), kv_cache


class GPT2Model(nnx.Module):
    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        h = config.hidden_size
        self.wte = VocabEmbedding(config.vocab_size, h, dtype=dtype, rngs=rngs)
        self.wpe = PositionEmbedding(config.max_position_embeddings, h, dtype=dtype, rngs=rngs)
        self.h = nnx.List(
            [GPT2Block(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_hidden_layers)]
        )
        self.ln_f = LayerNorm(h, config.layer_norm_epsilon, dtype=dtype)

    def __call__(
        self, input_ids: jax.Array, kv_caches: list[jax.Array], metadata: AttentionMetadata
    ) -> tuple[jax.Array, list[jax.Array]]:
        positions = metadata.positions
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        new_caches = []
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            hidden_states, kv_cache = block(positions, hidden_states, kv_cache, metadata)
            new_caches.append(kv_cache)
        return self.ln_f(hidden_states), new_caches


class GPT2LMHeadModel(LlamaForCausalLM):
    """GPT-2 causal LM; the LM head is the token embedding (tied)."""

    def __init__(self, hf_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        if not getattr(hf_config, "tie_word_embeddings", True):
            raise ValueError("GPT-2 with tie_word_embeddings=False is not supported: allowed True")
        self.transformer = GPT2Model(hf_config, dtype=dtype, rngs=rngs)
        self.tie_word_embeddings = True
        self.lm_head = None

    def __call__(
        self, input_ids: jax.Array, kv_caches: list[jax.Array], metadata: AttentionMetadata
    ) -> tuple[jax.Array, list[jax.Array]]:
        return self.transformer(input_ids, kv_caches, metadata)

    def compute_logits(self, hidden_states: jax.Array) -> jax.Array:
        return self.transformer.wte.attend(hidden_states)

    def attention_ops(self) -> list:
        return [block.attn.attn for block in self.transformer.h]

    def hf_weight_targets(
        self, name: str, param_shapes: dict[str, tuple[int, ...]]
    ) -> list[WeightTarget]:
        if name == "lm_head.weight" or name.endswith(_BUFFERS):
            return [WeightTarget.skip()]
        if not name.startswith("transformer."):  # the original openai-community/gpt2 names
            name = "transformer." + name
        name = name.replace(".attn.c_attn.", ".attn.qkv_proj.").replace(
            ".attn.c_proj.", ".attn.o_proj."
        )
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and f"{module}.kernel" in param_shapes:
            # Conv1D: already [in, out]; the quantized token table is stored [hidden, vocab].
            return [WeightTarget(f"{module}.kernel", transpose=module.endswith(".wte"))]
        return [WeightTarget(name)] if name in param_shapes else []
