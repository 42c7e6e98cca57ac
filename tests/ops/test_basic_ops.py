"""Native paths of RMSNorm, SiluAndMul and RotaryEmbedding against transformers."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from xlm.ops import RMSNorm, RotaryEmbedding, SiluAndMul

rng = np.random.default_rng(0)


def test_rms_norm_matches_transformers():
    x = rng.standard_normal((5, 32)).astype(np.float32)
    weight = rng.standard_normal(32).astype(np.float32)
    ref = LlamaRMSNorm(32, eps=1e-5)
    ref.weight.data = torch.from_numpy(weight)
    norm = RMSNorm(32, eps=1e-5)
    norm.weight[...] = jnp.asarray(weight)
    expected = ref(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_fused_residual():
    x = rng.standard_normal((3, 16)).astype(np.float32)
    r = rng.standard_normal((3, 16)).astype(np.float32)
    norm = RMSNorm(16)
    out, residual = norm(jnp.asarray(x), jnp.asarray(r))
    np.testing.assert_allclose(np.asarray(residual), x + r, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(norm(jnp.asarray(x + r))), rtol=1e-6)


def test_rms_norm_weight_offset():
    x = rng.standard_normal((2, 8)).astype(np.float32)
    norm = RMSNorm(8, weight_offset=1.0)  # Gemma style: (1 + w), w initialized to 0
    expected = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), expected, rtol=1e-5)


def test_silu_and_mul():
    x = rng.standard_normal((4, 10)).astype(np.float32)
    gate, up = torch.from_numpy(x[:, :5]), torch.from_numpy(x[:, 5:])
    expected = (torch.nn.functional.silu(gate) * up).numpy()
    np.testing.assert_allclose(
        np.asarray(SiluAndMul()(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-6
    )


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def _hf_cos_sin(scaling, head_dim, max_pos, base, positions):
    params = {"rope_type": "default", "rope_theta": base}
    params.update(scaling or {})
    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )
    inv_freq, attention_factor = (
        ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
        if params["rope_type"] != "default"
        else (1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim), 1.0)
    )
    freqs = torch.from_numpy(positions).float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


@pytest.mark.parametrize("kind", list(ROPE_CASES))
def test_rotary_neox_matches_transformers(kind):
    head_dim, max_pos, base = 32, 256, 10000.0
    positions = np.array([0, 1, 5, 63, 64, 200], dtype=np.int32)
    q = rng.standard_normal((6, 4, head_dim)).astype(np.float32)
    k = rng.standard_normal((6, 2, head_dim)).astype(np.float32)
    rope = RotaryEmbedding(head_dim, head_dim, max_pos, base, True, ROPE_CASES[kind])
    got_q, got_k = rope(jnp.asarray(positions), jnp.asarray(q), jnp.asarray(k))
    # Below max_pos dynamic NTK equals the default rope in transformers too.
    cos, sin = _hf_cos_sin(ROPE_CASES[kind], head_dim, max_pos, base, positions)
    # transformers: [batch, heads, seq, dim]
    tq = torch.from_numpy(q).permute(1, 0, 2)[None]
    tk = torch.from_numpy(k).permute(1, 0, 2)[None]
    ref_q, ref_k = apply_rotary_pos_emb(tq, tk, cos[None], sin[None])
    np.testing.assert_allclose(
        np.asarray(got_q), ref_q[0].permute(1, 0, 2).numpy(), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(
        np.asarray(got_k), ref_k[0].permute(1, 0, 2).numpy(), rtol=1e-4, atol=1e-4
    )


def test_rotary_gptj_style_and_partial_rotary():
    head_dim, rotary_dim = 16, 8
    positions = np.array([0, 3, 7], dtype=np.int32)
    q = rng.standard_normal((3, 2, head_dim)).astype(np.float32)
    rope = RotaryEmbedding(head_dim, rotary_dim, 128, 10000.0, is_neox_style=False)
    got, _ = rope(jnp.asarray(positions), jnp.asarray(q), jnp.asarray(q))
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angle = positions[:, None, None] * inv_freq[None, None, :]
    x1, x2 = q[..., 0:rotary_dim:2], q[..., 1:rotary_dim:2]
    expected = q.copy()
    expected[..., 0:rotary_dim:2] = x1 * np.cos(angle) - x2 * np.sin(angle)
    expected[..., 1:rotary_dim:2] = x2 * np.cos(angle) + x1 * np.sin(angle)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_rotary_dynamic_grows_base_past_original_length():
    rope = RotaryEmbedding(16, 16, 32, 10000.0, rope_scaling=ROPE_CASES["dynamic"])
    plain = RotaryEmbedding(16, 16, 32, 10000.0)
    x = jnp.ones((2, 1, 16))
    short, _ = rope(jnp.array([3, 31]), x, x)
    short_ref, _ = plain(jnp.array([3, 31]), x, x)
    np.testing.assert_allclose(np.asarray(short), np.asarray(short_ref), rtol=1e-6)
    long, _ = rope(jnp.array([100]), x[:1], x[:1])
    long_ref, _ = plain(jnp.array([100]), x[:1], x[:1])
    assert not np.allclose(np.asarray(long), np.asarray(long_ref))


def test_rotary_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="rope_type='longrope2'"):
        RotaryEmbedding(16, 16, 32, 10000.0, rope_scaling={"rope_type": "longrope2"})
