"""Native paths of the GELU/ReLU/SiLU activations against transformers."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.activations import ACT2FN

from xlm.ops import CustomOp, get_act_and_mul_fn, get_act_fn

rng = np.random.default_rng(0)


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
