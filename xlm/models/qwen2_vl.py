"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`): a vision transformer over flattened patches, the
2x2 patch merger, and the Qwen2 decoder with M-RoPE (three position streams).

`encode_images` is the encoder program's body over a bucket of patches (several images
packed, padding masked): attention runs only within an image (and, for Qwen2.5-VL's
windowed layers, within a window), which the segment ids given by the host describe.
transformers reorders patches by window before the blocks and back after the merger; with
masks by segment that order changes nothing, so the patches stay in the processor's order.
The host side (xlm.multimodal.qwen2_vl) builds those arrays and the M-RoPE positions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlm.models.clip import WeightHolder, _linear, vision_act
from xlm.models.qwen2 import Qwen2ForCausalLM
from xlm.models.qwen2_vl_inputs import PatchCountLayout, step_mrope_positions
from xlm.models.weights import WeightTarget, default_weight_targets
from xlm.multimodal.budget import qwen2_vl_max_tokens
from xlm.ops import LayerNorm, RMSNorm

# Checkpoint name prefixes (transformers 5's layout and the older one) -> xlm's.
_PREFIXES = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
)
_MASKED = -1e30


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class VisionAttention(nnx.Module):
    """Fused-qkv attention with 2D rotary positions, masked to a segment (image or window)."""

    def __init__(self, dim: int, heads: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = _linear(dim, 3 * dim, dtype, rngs)
        self.proj = _linear(dim, dim, dtype, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        n = x.shape[0]
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim), 1, 0)
        c, s = cos[:, None, :], sin[:, None, :]
        qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
        q = (qf * c + _rotate_half(qf) * s).astype(x.dtype)
        k = (kf * c + _rotate_half(kf) * s).astype(x.dtype)
        scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[None], scores * self.head_dim**-0.5, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.proj(jnp.einsum("hqk,khd->qhd", probs, v).reshape(n, -1))


class VisionMlp(nnx.Module):
    """Qwen2-VL's fc1 -> act -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.fc1 = _linear(dim, hidden, dtype, rngs)
        self.fc2 = _linear(hidden, dim, dtype, rngs)
        self.act = vision_act(act)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMlp(nnx.Module):
    """Qwen2.5-VL's down(act(gate(x)) * up(x)), biased."""

    def __init__(self, dim: int, hidden: int, act: str, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.gate_proj = _linear(dim, hidden, dtype, rngs)
        self.up_proj = _linear(dim, hidden, dtype, rngs)
        self.down_proj = _linear(hidden, dim, dtype, rngs)
        self.act = jax.nn.silu if act == "silu" else vision_act(act)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nnx.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); LayerNorm (2-VL) or RMSNorm (2.5-VL)."""

    def __init__(self, config: Any, v25: bool, *, dtype: Any, rngs: nnx.Rngs) -> None:
        dim = config.hidden_size if v25 else config.embed_dim
        norm = (
            (lambda: RMSNorm(dim, 1e-6, dtype=dtype))
            if v25
            else (lambda: LayerNorm(dim, 1e-6, dtype=dtype))
        )
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, config.num_heads, dtype=dtype, rngs=rngs)
        if v25:
            self.mlp = VisionGatedMlp(
                dim, config.intermediate_size, config.hidden_act, dtype=dtype, rngs=rngs
            )
        else:
            hidden = int(dim * config.mlp_ratio)
            self.mlp = VisionMlp(dim, hidden, config.hidden_act, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """norm, then each 2x2 block of patches (consecutive in the processor's order) through
    Linear -> GELU -> Linear into the language model's width."""

    def __init__(self, config: Any, v25: bool, *, dtype: Any, rngs: nnx.Rngs) -> None:
        context = config.hidden_size if v25 else config.embed_dim
        out = config.out_hidden_size if v25 else config.hidden_size
        self.unit = config.spatial_merge_size**2
        self.ln_q = (
            RMSNorm(context, 1e-6, dtype=dtype) if v25 else LayerNorm(context, 1e-6, dtype=dtype)
        )
        self.mlp0 = _linear(context * self.unit, context * self.unit, dtype, rngs)
        self.mlp2 = _linear(context * self.unit, out, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.ln_q(x).reshape(x.shape[0] // self.unit, -1)
        return self.mlp2(jax.nn.gelu(self.mlp0(x), approximate=False))


class PatchEmbed(nnx.Module):
    """Holds the checkpoint's Conv3d weight [out, C, T, p, p] (stride = kernel: a matmul)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.proj = WeightHolder(shape, dtype)


class Qwen2VisionTransformer(nnx.Module):
    """Patch embedding (the Conv3d as one matmul), the blocks, the merger; replicated
    under tensor parallelism like CLIP's tower (docs/multimodal.md)."""

    def __init__(self, config: Any, v25: bool, *, dtype: Any, rngs: nnx.Rngs) -> None:
        dim = config.hidden_size if v25 else config.embed_dim
        c, t, p = config.in_channels, config.temporal_patch_size, config.patch_size
        self.patch_embed = PatchEmbed((dim, c, t, p, p), dtype)
        self.blocks = nnx.List(
            [VisionBlock(config, v25, dtype=dtype, rngs=rngs) for _ in range(config.depth)]
        )
        self.merger = PatchMerger(config, v25, dtype=dtype, rngs=rngs)
        head_dim = dim // config.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        quarter = np.arange(0, head_dim // 2, 2, dtype=np.float64) / (head_dim // 2)
        self.inv_freq = tuple(float(f) for f in 1.0 / theta**quarter)
        # Qwen2.5-VL: the blocks with full attention (the others attend within windows).
        full = tuple(getattr(config, "fullatt_block_indexes", None) or ())
        self.full_blocks = full if v25 else None

    def __call__(
        self, patches: jax.Array, pos: jax.Array, seg: jax.Array, win: jax.Array
    ) -> jax.Array:
        """patches [P, C*T*p*p], pos [P, 2] (row, column), seg [P] (image; -1 padding),
        win [P] (window) -> merged tokens [P / 4, out hidden]."""
        w = self.patch_embed.proj.weight[...]
        x = patches.astype(w.dtype) @ w.reshape(w.shape[0], -1).T
        freqs = pos.astype(jnp.float32)[:, :, None] * jnp.asarray(self.inv_freq, jnp.float32)
        freqs = freqs.reshape(pos.shape[0], -1)  # [P, head_dim / 2]: rows' then columns'
        freqs = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(freqs), jnp.sin(freqs)
        full = seg[:, None] == seg[None, :]
        window = full & (win[:, None] == win[None, :])
        for i, block in enumerate(self.blocks):
            windowed = self.full_blocks is not None and i not in self.full_blocks
            x = block(x, cos, sin, window if windowed else full)
        return self.merger(x)


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2-VL: the Qwen2 decoder with M-RoPE, plus the vision transformer."""

    is_v25 = False

    def __init__(self, hf_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(hf_config.text_config, dtype=dtype, rngs=rngs)
        # transformers 5 reads tying from the outer config (Qwen2-VL-2B ties).
        if getattr(hf_config, "tie_word_embeddings", False) and self.lm_head is not None:
            self.lm_head = None
            self.tie_word_embeddings = True
        self.visual = Qwen2VisionTransformer(
            hf_config.vision_config, self.is_v25, dtype=dtype, rngs=rngs
        )
        self.merge_size = hf_config.vision_config.spatial_merge_size

    def encoder_layout(self, hf_config: Any, processor_config: dict | None) -> PatchCountLayout:
        """How the runner packs images into the encoder program (by patch count), under
        the engine's preprocessor config (xlm.multimodal.processor_config)."""
        min_pixels, max_tokens = qwen2_vl_max_tokens(processor_config)
        return PatchCountLayout(hf_config.vision_config, min_pixels, max_tokens)

    def mrope_positions(
        self, features: list[Any], starts: Any, counts: Any, num_tokens_padded: int
    ) -> np.ndarray:
        """The step's M-RoPE positions [3, T] (the attention metadata's positions)."""
        return step_mrope_positions(features, starts, counts, num_tokens_padded, self.merge_size)

    def encode_images(
        self, patches: jax.Array, pos: jax.Array, seg: jax.Array, win: jax.Array
    ) -> jax.Array:
        """A bucket of packed patches -> one embedding per merged token [P / 4, hidden]."""
        return self.visual(patches, pos, seg, win)

    def embed_input_ids(self, input_ids: jax.Array) -> jax.Array:
        """The language model's token embeddings [T, H] (placeholders then replaced)."""
        return self.model.embed_tokens(input_ids)

    def embed_dtype(self) -> Any:
        return self.model.embed_tokens.weight.dtype

    def hf_weight_targets(
        self, name: str, param_shapes: dict[str, tuple[int, ...]]
    ) -> list[WeightTarget]:
        """Both checkpoint layouts onto the decoder's and the vision tower's parameters."""
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        name = name.replace("visual.merger.mlp.0.", "visual.merger.mlp0.")
        name = name.replace("visual.merger.mlp.2.", "visual.merger.mlp2.")
        return super().hf_weight_targets(name, param_shapes) or default_weight_targets(
            name, param_shapes
        )


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801
    """Qwen2.5-VL: RMSNorm, gated MLPs and windowed attention in the vision transformer."""

    is_v25 = True
