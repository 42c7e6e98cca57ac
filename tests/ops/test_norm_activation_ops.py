"""Native paths of LayerNorm and the GELU/ReLU activations against torch / transformers."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.activations import ACT2FN

from xlm.ops import CustomOp, LayerNorm, get_act_and_mul_fn, get_act_fn

rng = np.random.default_rng(0)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_torch(bias):
    x = (3.0 + 2.0 * rng.standard_normal((5, 32))).astype(np.float32)
    weight = rng.standard_normal(32).astype(np.float32)
    ref = torch.nn.LayerNorm(32, eps=1e-5, bias=bias)
    ref.weight.data = torch.from_numpy(weight)
    norm = LayerNorm(32, eps=1e-5, bias=bias)
    norm.weight[...] = jnp.asarray(weight)
    if bias:
        b = rng.standard_normal(32).astype(np.float32)
        ref.bias.data = torch.from_numpy(b)
        norm.bias[...] = jnp.asarray(b)
    expected = ref(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh", "relu"])
def test_activation_matches_transformers(name):
    x = (3.0 * rng.standard_normal((4, 64))).astype(np.float32)
    expected = ACT2FN[name](torch.from_numpy(x)).numpy()
    got = np.asarray(get_act_fn(name)(jnp.asarray(x)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gelu", "gelu_pytorch_tanh", "silu"])
def test_gated_activation_matches_transformers(name):
    x = (3.0 * rng.standard_normal((4, 20))).astype(np.float32)
    gate, up = torch.from_numpy(x[:, :10]), torch.from_numpy(x[:, 10:])
    expected = (ACT2FN[name](gate) * up).numpy()
    got = np.asarray(get_act_and_mul_fn(name)(jnp.asarray(x)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_tanh_and_exact_gelu_differ():
    # The approximation is a real switch: the tests above would catch a swapped default.
    x = jnp.linspace(-3, 3, 64)
    assert float(jnp.abs(get_act_fn("gelu")(x) - get_act_fn("gelu_new")(x)).max()) > 1e-4


def test_unknown_activation_names_the_allowed_ones():
    with pytest.raises(ValueError, match="gelu_new"):
        get_act_fn("swishy")
    with pytest.raises(ValueError, match="approximate"):
        get_act_and_mul_fn("gelu").__class__("sigmoid")


def test_new_ops_are_registered_custom_ops():
    for name in ("layer_norm", "gelu", "gelu_and_mul", "relu"):
        assert name in CustomOp.op_registry


@pytest.mark.parametrize("long", [False, True])
def test_longrope_matches_transformers_short_and_long(long):
    """Phi-3 LongRoPE: short factors inside the original context, long factors past it
    (xlm decides per token; transformers per sequence, equal when all positions agree)."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from xlm.ops import RotaryEmbedding

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
