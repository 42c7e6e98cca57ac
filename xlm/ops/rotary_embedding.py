"""Rotary position embedding: neox and GPT-J styles; linear, dynamic-NTK, llama3, YaRN and
LongRoPE (Phi-3 "longrope"/"su") scaling.

Scaling rules follow the formulas transformers uses, so logits match it; inverse
frequencies are computed in numpy at trace time and become XLA constants.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlm.ops.custom_op import CustomOp

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "su")


def _base_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    return 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, rotary_dim: int, max_position: int, scaling: dict[str, Any]
) -> tuple[np.ndarray, float]:
    factor = scaling["factor"]
    original_max = scaling.get("original_max_position_embeddings") or max_position
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(
                factor, mscale_all_dim
            )
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (
            rotary_dim
            * math.log(original_max / (num_rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return inv_freq, float(attention_factor)


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """Rotates the first `rotary_dim` channels of each query/key head by its position."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        rope_scaling: dict[str, Any] | None = None,
        *,
        mrope_section: tuple[int, ...] | None = None,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_size={head_size}")
        scaling = dict(rope_scaling or {})
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling rope_type={rope_type!r} is not supported; supported: {ROPE_TYPES}"
            )
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = float(base)
        self.is_neox_style = is_neox_style
        self.rope_type = rope_type
        # M-RoPE (Qwen2-VL): positions [3, T]; frequency band i of mrope_section rotates
        # by position stream i % 3 (temporal, height, width).
        self.mrope_section = tuple(mrope_section) if mrope_section else None
        if self.mrope_section and sum(self.mrope_section) != rotary_dim // 2:
            raise ValueError(
                f"mrope_section={list(self.mrope_section)} must sum to rotary_dim / 2 = "
                f"{rotary_dim // 2}"
            )
        # Hashable: lists (LongRoPE's per-frequency factors) become tuples.
        self.scaling = tuple(
            sorted(
                (k, tuple(v) if isinstance(v, list) else v)
                for k, v in scaling.items()
                if isinstance(v, int | float | str | list | tuple | None)
            )
        )

    def _inv_freq(self) -> tuple[np.ndarray, float]:
        scaling = dict(self.scaling)
        inv_freq = _base_inv_freq(self.base, self.rotary_dim)
        if self.rope_type == "linear":
            return inv_freq / scaling["factor"], 1.0
        if self.rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, scaling), 1.0
        if self.rope_type == "yarn":
            return _yarn_inv_freq(self.base, self.rotary_dim, self.max_position_embeddings, scaling)
        if self.rope_type in ("longrope", "su"):
            return inv_freq / np.asarray(scaling["short_factor"], np.float64), 1.0
        return inv_freq, 1.0

    def _longrope(self) -> tuple[np.ndarray, int, float]:
        """LongRoPE's long-context inverse frequencies, switch position and cos/sin factor."""
        scaling = dict(self.scaling)
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or self.max_position_embeddings / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            )
        inv_freq = _base_inv_freq(self.base, self.rotary_dim)
        long = inv_freq / np.asarray(scaling["long_factor"], np.float64)
        return long, original, float(attention_factor)

    def _freqs(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        inv_freq, attention_factor = self._inv_freq()
        if positions.ndim == 2:  # M-RoPE: each frequency reads its band's position stream
            if self.mrope_section is None:
                raise ValueError("positions [3, T] need a rotary embedding with mrope_section")
            stream = np.repeat(np.arange(len(self.mrope_section)) % 3, self.mrope_section)
            pos = positions.astype(jnp.float32)[stream].T  # [T, rotary_dim / 2]
            freqs = pos * jnp.asarray(inv_freq, dtype=jnp.float32)[None, :]
            return jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor
        pos = positions.astype(jnp.float32)[:, None]
        if self.rope_type == "dynamic":
            # NTK-aware base grows with the sequence length once it exceeds the original
            # context; per token, from its own position (equal to transformers below it).
            factor = dict(self.scaling)["factor"]
            max_pos = self.max_position_embeddings
            seq_len = jnp.maximum(pos + 1.0, float(max_pos))
            base = self.base * ((factor * seq_len / max_pos) - (factor - 1)) ** (
                self.rotary_dim / (self.rotary_dim - 2)
            )
            exponents = jnp.arange(0, self.rotary_dim, 2, dtype=jnp.float32) / self.rotary_dim
            freqs = pos / (base ** exponents[None, :])
        elif self.rope_type in ("longrope", "su"):
            # Per token: positions past the original context rotate with the long factors.
            # transformers switches the whole sequence once it is longer than that; equal
            # below it (vLLM makes the same per-token choice, which keeps cached KV valid).
            long_inv, original, attention_factor = self._longrope()
            short = pos * jnp.asarray(inv_freq, dtype=jnp.float32)[None, :]
            long = pos * jnp.asarray(long_inv, dtype=jnp.float32)[None, :]
            freqs = jnp.where(pos >= original, long, short)
        else:
            freqs = pos * jnp.asarray(inv_freq, dtype=jnp.float32)[None, :]
        return jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor

    def _rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        rd = self.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        cos = cos[:, None, :].astype(x.dtype)
        sin = sin[:, None, :].astype(x.dtype)
        if self.is_neox_style:
            x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
            out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
            out = out.reshape(rot.shape)
        return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out

    def forward_native(
        self, positions: jax.Array, query: jax.Array, key: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """positions [T]; query [T, Hq, D]; key [T, Hk, D]."""
        cos, sin = self._freqs(positions)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
