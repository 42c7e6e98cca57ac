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
