"""LayerNorm's native path against torch's, with and without a bias."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from xlm.ops import LayerNorm

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
