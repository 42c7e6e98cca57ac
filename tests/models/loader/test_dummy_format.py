"""dummy_value: deterministic per parameter and seed, distinct between parameters, zero
biases, unit norm weights, and matrices at the scale of their fan-in (a whole model loaded
with load_format="dummy": tests/models/test_loader.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from xlm.models.loader.dummy_format import dummy_value, dummy_values


def test_values_are_deterministic_per_path_and_seed():
    path, shape = "model.layers.0.self_attn.q_proj.kernel", (64, 32)
    a = dummy_value(path, shape, seed=1)
    np.testing.assert_array_equal(a, dummy_value(path, shape, seed=1))
    assert not np.array_equal(a, dummy_value(path, shape, seed=2))
    other = dummy_value("model.layers.0.self_attn.k_proj.kernel", shape, seed=1)
    assert not np.array_equal(a, other)
    assert a.dtype == np.float32 and a.shape == shape
    assert len(np.unique(a)) == a.size  # no value repeats inside one matrix


def test_biases_are_zero_and_vectors_one():
    np.testing.assert_array_equal(dummy_value("x.bias", (5,), 0), np.zeros(5, np.float32))
    np.testing.assert_array_equal(dummy_value("x.bias", (2, 3), 0), np.zeros((2, 3)))
    np.testing.assert_array_equal(dummy_value("model.norm.weight", (7,), 0), np.ones(7))


@pytest.mark.parametrize(
    "path, shape, fan_in",
    [
        ("model.layers.0.mlp.down_proj.kernel", (256, 64), 256),  # [in, out]
        ("model.embed_tokens.weight", (512, 64), 64),  # [vocab, hidden]
        ("model.layers.0.mlp.experts.kernel", (4, 128, 32), 128),  # [experts, in, out]
    ],
)
def test_matrices_have_unit_variance_times_fan_in(path, shape, fan_in):
    """Uniform on [-sqrt(3), sqrt(3)] / sqrt(fan_in): variance 1 / fan_in."""
    value = dummy_value(path, shape, seed=0)
    bound = math.sqrt(3 / fan_in)
    assert np.abs(value).max() <= bound * (1 + 1e-6)
    assert abs(value.std() * math.sqrt(fan_in) - 1) < 0.05
    assert abs(value.mean()) * math.sqrt(fan_in) < 0.05


def test_values_drawn_on_threads_come_in_order_and_equal_one_by_one(monkeypatch):
    """dummy_values (load_format="dummy" draws on a thread per core) yields each
    parameter's dummy_value in the order asked, also with more parameters than threads."""
    monkeypatch.setattr("os.cpu_count", lambda: 3)
    params = [(f"model.layers.{i}.mlp.down_proj.kernel", (16 + i, 8)) for i in range(10)]
    params.append(("model.norm.weight", (8,)))
    got = list(dummy_values(params, seed=4))
    assert [p for p, _ in got] == [p for p, _ in params]
    for (path, shape), (_, value) in zip(params, got):
        np.testing.assert_array_equal(value, dummy_value(path, shape, seed=4))
