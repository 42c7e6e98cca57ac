"""RotaryEmbedding against transformers' rope initialisers."""

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from xlm.ops import RotaryEmbedding

rng = np.random.default_rng(0)


@pytest.mark.parametrize("long", [False, True])
def test_longrope_matches_transformers_short_and_long(long):
    """Phi-3 LongRoPE: short factors inside the original context, long factors past it
    (xlm decides per token; transformers per sequence, equal when all positions agree)."""
    head, original = 16, 32
    scaling = dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.3 * i for i in range(head // 2)],
        long_factor=[2.0 + 0.7 * i for i in range(head // 2)],
        original_max_position_embeddings=original,
    )
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        original_max_position_embeddings=original,
        rope_scaling=scaling,
    )
    positions = np.arange(40, 50) if long else np.arange(0, 10)
    seq_len = int(positions.max()) + 1
    inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=seq_len)
    freqs = positions[:, None] * inv_freq.numpy()[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb) * factor, np.sin(emb) * factor
    x = rng.standard_normal((len(positions), 2, head)).astype(np.float32)
    rotate = np.concatenate([-x[..., head // 2 :], x[..., : head // 2]], axis=-1)
    expected = x * cos[:, None] + rotate * sin[:, None]
    rope = RotaryEmbedding(head, head, 128, 10000.0, rope_scaling=scaling)
    q, _ = rope(jnp.asarray(positions, jnp.int32), jnp.asarray(x), jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(q), expected, rtol=1e-4, atol=1e-4)


def test_mrope_matches_transformers_recomposition():
    """M-RoPE (Qwen2-VL): positions [3, T]; frequency band i of mrope_section rotates by
    stream i % 3, as transformers' Qwen2_5_VLRotaryEmbedding recomposes cos/sin."""
    import torch
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    head, section, t = 16, (2, 3, 3), 5
    params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section)}
    config = Qwen2_5_VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters=params)
    rope = RotaryEmbedding(head, head, 512, 10000.0, mrope_section=section)
    positions = rng.integers(0, 50, (3, t)).astype(np.int32)
    q = rng.standard_normal((t, 2, head)).astype(np.float32)
    k = rng.standard_normal((t, 1, head)).astype(np.float32)
    got_q, got_k = rope.forward_native(jnp.asarray(positions), jnp.asarray(q), jnp.asarray(k))
    tq, tk = torch.tensor(q).transpose(0, 1)[None], torch.tensor(k).transpose(0, 1)[None]
    cos, sin = Qwen2_5_VLRotaryEmbedding(config)(tq, torch.tensor(positions)[:, None])
    want_q, want_k = apply_rotary_pos_emb(tq, tk, cos, sin)
    np.testing.assert_allclose(got_q, want_q[0].transpose(0, 1).numpy(), atol=1e-5)
    np.testing.assert_allclose(got_k, want_k[0].transpose(0, 1).numpy(), atol=1e-5)
    # Equal streams: plain 1D RoPE.
    same = np.stack([positions[0]] * 3)
    plain = RotaryEmbedding(head, head, 512, 10000.0)
    np.testing.assert_allclose(
        rope.forward_native(jnp.asarray(same), jnp.asarray(q), jnp.asarray(k))[0],
        plain.forward_native(jnp.asarray(positions[0]), jnp.asarray(q), jnp.asarray(k))[0],
        atol=1e-5,
    )
