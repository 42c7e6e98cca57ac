"""The CLIP vision transformer (LLaVA's vision tower): patch embedding, class token,
learned positions, pre-LayerNorm, bidirectional encoder layers with quick-GELU MLPs; and
SigLIP's (Gemma 3's): the same layers, no class token, a post-LayerNorm.

Every parameter is replicated over the mesh: under tensor parallelism each device runs
the whole encoder (docs/multimodal.md), which is small next to the language model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.models.layers import Linear, param, unloaded
from xlm.ops import LayerNorm


def _linear(n_in: int, n_out: int, dtype: Any, rngs: nnx.Rngs, bias: bool = True) -> Linear:
    # Replicated, never quantized, no LoRA slots: the vision tower is not the LM's.
    return Linear(n_in, n_out, bias=bias, dtype=dtype, rngs=rngs, lora=False, quantize=False)


def quick_gelu(x: jax.Array) -> jax.Array:
    """x * sigmoid(1.702 x), CLIP's activation."""
    return x * jax.nn.sigmoid(1.702 * x)


_ACTS = {
    "quick_gelu": quick_gelu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def vision_act(name: str) -> Any:
    """The activation function for a vision config's hidden_act."""
    if name not in _ACTS:
        raise ValueError(f"vision hidden_act {name!r} is not supported; allowed: {sorted(_ACTS)}")
    return _ACTS[name]


class WeightHolder(nnx.Module):
    """A module holding one replicated `weight` (a checkpoint's conv or embedding table),
    and the conv's `bias` when it has one."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, bias: bool = False) -> None:
        self.weight = param(unloaded(shape, dtype), (None,) * len(shape))
        self.bias = param(unloaded(shape[:1], dtype), (None,)) if bias else None


class CLIPVisionEmbeddings(nnx.Module):
    """Non-overlapping patches (a strided conv as one matmul), a class token, positions."""

    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        c, p, h = config.num_channels, config.patch_size, config.hidden_size
        self.patch_size = p
        self.num_patches = (config.image_size // p) ** 2
        self.class_embedding = param(unloaded((h,), dtype), (None,))
        # HF's Conv2d weight [out, in, p, p], loaded as is.
        self.patch_embedding = WeightHolder((h, c, p, p), dtype)
        self.position_embedding = WeightHolder((self.num_patches + 1, h), dtype)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [B, C, H, W] -> [B, 1 + patches, hidden]."""
        b, c, height, width = pixel_values.shape
        p = self.patch_size
        x = pixel_values.reshape(b, c, height // p, p, width // p, p)
        x = x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (height // p) * (width // p), c * p * p)
        w = self.patch_embedding.weight[...]
        patches = x @ w.reshape(w.shape[0], -1).T.astype(x.dtype)
        cls = jnp.broadcast_to(self.class_embedding[...], (b, 1, patches.shape[-1]))
        x = jnp.concatenate([cls.astype(patches.dtype), patches], axis=1)
        return x + self.position_embedding.weight[...][None]


class CLIPAttention(nnx.Module):
    """Full (bidirectional) multi-head self-attention over one image's tokens."""

    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        self.q_proj = _linear(h, h, dtype, rngs)
        self.k_proj = _linear(h, h, dtype, rngs)
        self.v_proj = _linear(h, h, dtype, rngs)
        self.out_proj = _linear(h, h, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, h = x.shape

        def heads(t: jax.Array) -> jax.Array:
            return t.reshape(b, n, self.num_heads, self.head_dim)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores * self.head_dim**-0.5, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, h)
        return self.out_proj(out)


class CLIPMLP(nnx.Module):
    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.fc1 = _linear(config.hidden_size, config.intermediate_size, dtype, rngs)
        self.fc2 = _linear(config.intermediate_size, config.hidden_size, dtype, rngs)
        self.act = vision_act(config.hidden_act)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        eps = config.layer_norm_eps
        self.layer_norm1 = LayerNorm(config.hidden_size, eps, dtype=dtype)
        self.self_attn = CLIPAttention(config, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(config.hidden_size, eps, dtype=dtype)
        self.mlp = CLIPMLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionTransformer(nnx.Module):
    """Embeddings, pre-LayerNorm and the encoder layers up to the one whose output is read.

    `num_layers` is how many layers run (LLaVA reads layer -2: the last one never runs);
    the post-LayerNorm exists for the checkpoint but is not applied to hidden states.
    """

    def __init__(self, config: Any, num_layers: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.embeddings = CLIPVisionEmbeddings(config, dtype=dtype, rngs=rngs)
        self.pre_layrnorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)
        self.layers = nnx.List(
            [CLIPEncoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(num_layers)]
        )

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [B, C, H, W] -> the chosen layer's hidden states [B, 1 + N, D]."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionEmbeddings(nnx.Module):
    """SigLIP's embeddings: non-overlapping patches (a strided conv with bias, as one
    matmul) plus learned positions; no class token."""

    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        c, p, h = config.num_channels, config.patch_size, config.hidden_size
        self.patch_size = p
        self.num_patches = (config.image_size // p) ** 2
        self.patch_embedding = WeightHolder((h, c, p, p), dtype, bias=True)
        self.position_embedding = WeightHolder((self.num_patches, h), dtype)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [B, C, H, W] -> [B, patches, hidden] (patches row-major)."""
        b, c, height, width = pixel_values.shape
        p = self.patch_size
        x = pixel_values.reshape(b, c, height // p, p, width // p, p)
        x = x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (height // p) * (width // p), c * p * p)
        w = self.patch_embedding.weight[...]
        x = x @ w.reshape(w.shape[0], -1).T.astype(x.dtype)
        x = x + self.patch_embedding.bias[...].astype(x.dtype)
        return x + self.position_embedding.weight[...][None].astype(x.dtype)


class SiglipVisionTransformer(nnx.Module):
    """SigLIP's vision tower without its pooling head: embeddings, the encoder layers
    (CLIP's, with the config's activation) and the post-LayerNorm (Gemma 3's tower)."""

    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.embeddings = SiglipVisionEmbeddings(config, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [
                CLIPEncoderLayer(config, dtype=dtype, rngs=rngs)
                for _ in range(config.num_hidden_layers)
            ]
        )
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [B, C, H, W] -> last hidden states [B, patches, D]."""
        x = self.embeddings(pixel_values)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)
