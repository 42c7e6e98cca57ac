"""The quantized projection: xlm.quantization's numpy rules (weights per output channel,
w8a8's activations per token) and the op's paths equal their float64 definition."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from xlm.config import QUANTIZATION_METHODS
from xlm.ops.quant_matmul import QuantMatmul
from xlm.quantization import (
    SCHEMES,
    dequantize_weight,
    get_scheme,
    quantize_activations,
    quantize_weight,
    reference_matmul,
)


def test_schemes_are_the_configs_choices():
    assert tuple(SCHEMES) == QUANTIZATION_METHODS


@pytest.mark.parametrize("name", QUANTIZATION_METHODS)
def test_weight_rounding_is_within_half_a_step(name):
    scheme = get_scheme(name)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32) * np.linspace(0.01, 3, 40)
    w[:, 7] = 0.0  # an all-zero column keeps scale 1 and stays zero
    q, scale = quantize_weight(w, scheme)
    assert q.dtype == scheme.weight_dtype and scale.shape == (1, 40)
    assert q[:, 7].astype(np.float32).max() == 0
    deq = dequantize_weight(q, scale)
    # Each column's largest magnitude is represented exactly (up to float rounding).
    np.testing.assert_allclose(np.abs(deq).max(0), np.abs(w).max(0), rtol=1e-6)
    err = np.abs(deq - w)
    if scheme.weight_dtype == np.int8:
        assert (err <= scale / 2 * (1 + 1e-5)).all()
    else:  # e4m3 keeps 3 mantissa bits: relative error at most 2**-4 (normal numbers)
        normal = np.abs(w) / scale > 2.0**-6
        assert (err[normal] <= np.abs(w)[normal] * 2.0**-4 + 1e-7).all()


def test_activation_quantization_per_token():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 33)).astype(np.float32) * np.array([[0.1], [1], [10], [0], [3]])
    q, s = quantize_activations(x)
    assert q.dtype == np.int8 and s.shape == (5, 1)
    assert (np.abs(q).max(1)[[0, 1, 2, 4]] == 127).all() and not q[3].any()
    assert (np.abs(q * s - x) <= s / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("name", QUANTIZATION_METHODS)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_native_path_equals_definition(name, rows, groups):
    scheme = get_scheme(name)
    rng = np.random.default_rng(rows)
    k, n = 128, 48
    w = rng.standard_normal((k, n)).astype(np.float32)
    if groups == 1:
        q, scale = quantize_weight(w, scheme)
    else:  # grouped scales (GGUF-style blocks along the input)
        parts = [quantize_weight(b, scheme) for b in np.split(w, groups)]
        q = np.concatenate([p[0] for p in parts])
        scale = np.concatenate([p[1] for p in parts])
    x = rng.standard_normal((rows, k)).astype(np.float32)
    op = QuantMatmul(scheme.activations)
    got = np.asarray(jax.jit(op.forward_native)(x, q, scale))
    want = reference_matmul(x, q, scale, scheme)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # Leading dimensions pass through.
    got3 = np.asarray(op.forward_native(x.reshape(1, rows, k), q, scale))
    np.testing.assert_allclose(got3[0], got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 9])
def test_native_path_with_group_minimums(rows):
    """GGUF types with a minimum (Q4_1, Q4_K ...): W = codes * scale + min per group."""
    rng = np.random.default_rng(rows)
    k, n, g = 96, 40, 32
    codes = rng.integers(0, 16, size=(k, n)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, size=(k // g, n)).astype(np.float32)
    minimum = rng.uniform(-0.5, 0.0, size=(k // g, n)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = np.asarray(jax.jit(QuantMatmul().forward_native)(x, codes, scale, minimum))
    want = reference_matmul(x, codes, scale, get_scheme("gguf"), minimum)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("name", ["int8", "w8a8", "gguf"])
def test_cpu_path_equals_definition(name, rows):
    """forward_cpu (the FFI int8 kernel where it is faster, else the native path) equals
    the float64 definition, grouped scales and minimums included."""
    from xlm.ops import cpu_kernels

    assert cpu_kernels.available()  # CI has a compiler: the kernel path must be tested
    scheme = get_scheme(name)
    rng = np.random.default_rng(rows)
    k, n = 96, 56
    x = rng.standard_normal((rows, k)).astype(np.float32)
    minimum = None
    if name == "gguf":
        codes = rng.integers(0, 16, size=(k, n)).astype(np.int8)
        scale = rng.uniform(0.01, 0.1, size=(k // 32, n)).astype(np.float32)
        minimum = rng.uniform(-0.5, 0.0, size=(k // 32, n)).astype(np.float32)
    else:
        codes, scale = quantize_weight(rng.standard_normal((k, n)).astype(np.float32), scheme)
    op = QuantMatmul(scheme.activations)
    got = np.asarray(jax.jit(op.forward_cpu)(x, codes, scale, minimum))
    want = reference_matmul(x, codes, scale, scheme, minimum)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
