"""The quantized projection: xlm.quantization's numpy rules (weights per output channel,
w8a8's activations per token, int4's packed groups) and the op's paths equal their
float64 definition."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from xlm.config import QUANTIZATION_METHODS
from xlm.ops.quant_matmul import QuantMatmul
from xlm.quantization import (
    SCHEMES,
    QuantScheme,
    dequantize,
    dequantize_weight,
    get_scheme,
    int4_group_size,
    pack_int4,
    quantize_activations,
    quantize_int4,
    quantize_weight,
    unpack_int4,
)


def reference_matmul(
    x: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    scheme: QuantScheme,
    minimum: np.ndarray | None = None,
) -> np.ndarray:
    """float64 numpy definition of the quantized projection; `q` is the stored kernel
    (packed for int4)."""
    w = dequantize(q, scale, minimum, scheme).astype(np.float64)
    x = np.asarray(x, np.float32)
    if scheme.activations == "int8":  # per token and group of the weight's scales
        groups = scale.shape[0]
        xq, xs = quantize_activations(x.reshape(-1, x.shape[-1]), groups)
        blocks = xq.astype(np.float64).reshape(-1, groups, x.shape[-1] // groups)
        x = (blocks * xs[:, :, None]).reshape(x.shape)
    return np.asarray(x, np.float64) @ w


# The schemes that store one code per element (int4 packs two per byte: tested below).
UNPACKED = [name for name in QUANTIZATION_METHODS if not get_scheme(name).packed]


def test_schemes_are_the_configs_choices():
    assert tuple(SCHEMES) == QUANTIZATION_METHODS


@pytest.mark.parametrize("name", UNPACKED)
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


def test_activation_quantization_per_block():
    """w8a8 from float weights: a scale per token and block of 32 inputs (Q8_0's)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[:, 32:64] *= 100.0  # one loud block leaves the others their own resolution
    q, s = quantize_activations(x, 3)
    assert q.dtype == np.int8 and s.shape == (3, 3)
    blocks = x.reshape(3, 3, 32)
    np.testing.assert_allclose(s, np.abs(blocks).max(-1) / 127, rtol=1e-6)
    err = np.abs(q.reshape(3, 3, 32) * s[:, :, None] - blocks)
    assert (err <= s[:, :, None] / 2 * 1.00001).all()
    from xlm.ops.quant_matmul import quantize_activations as jnp_quantize

    jq, js = jnp_quantize(x, 3)
    np.testing.assert_array_equal(np.asarray(jq), q)
    np.testing.assert_allclose(np.asarray(js), s, rtol=1e-6)


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("name", UNPACKED)
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


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("name", ["int8", "w8a8", "gguf"])
def test_cpu_path_equals_definition(name, rows, groups):
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
    else:  # groups of 32 inputs: w8a8 from float weights (Q8_0's blocks)
        w = rng.standard_normal((k, n)).astype(np.float32)
        codes, scale = quantize_weight(w, scheme, k // groups)
    op = QuantMatmul(scheme.activations)
    got = np.asarray(jax.jit(op.forward_cpu)(x, codes, scale, minimum))
    want = reference_matmul(x, codes, scale, scheme, minimum)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_int4_packs_two_codes_per_byte():
    codes = np.arange(32, dtype=np.uint8).reshape(8, 4) % 16
    packed = pack_int4(codes)
    assert packed.dtype == np.uint8 and packed.shape == (4, 4)  # in * out / 2 bytes
    # Input row 2i in the low nibble of byte row i, row 2i + 1 in the high one.
    np.testing.assert_array_equal(packed & 15, codes[0::2])
    np.testing.assert_array_equal(packed >> 4, codes[1::2])
    np.testing.assert_array_equal(unpack_int4(packed), codes)


def test_int4_rounding_is_within_half_a_step_of_each_group():
    rng = np.random.default_rng(0)
    k, n, g = 96, 40, 32
    w = rng.standard_normal((k, n)).astype(np.float32) * np.linspace(0.01, 3, n)
    w[:, 7] = 0.0  # an all-zero column keeps scale 1 and stays zero
    w[:, 8] = 0.25  # a constant column is exact (its minimum)
    kernel, scale, minimum = quantize_int4(w, g)
    assert kernel.shape == (k // 2, n) and kernel.nbytes == k * n // 2
    assert scale.shape == minimum.shape == (k // g, n) and scale.dtype == np.float32
    deq = dequantize(kernel, scale, minimum, get_scheme("int4"))
    assert not deq[:, 7].any() and (deq[:, 8] == 0.25).all()
    groups = w.reshape(k // g, g, n)
    # Each group's minimum and maximum are represented (up to float rounding).
    np.testing.assert_allclose(deq.reshape(k // g, g, n).min(1), groups.min(1), atol=1e-6)
    np.testing.assert_allclose(deq.reshape(k // g, g, n).max(1), groups.max(1), rtol=1e-5)
    err = np.abs(deq - w).reshape(k // g, g, n)
    assert (err <= scale[:, None, :] / 2 * (1 + 1e-4) + 1e-7).all()


def test_int4_group_size_fits_each_shard():
    assert int4_group_size(1536) == 128
    assert int4_group_size(576) == 64  # SmolLM2's hidden size: 4.5 groups of 128
    assert int4_group_size(1536, shards=4) == 128
    assert int4_group_size(576, shards=2) == 32  # 288 inputs per device
    assert int4_group_size(100) == 100  # per output channel
    with pytest.raises(ValueError, match="in_features=99"):
        int4_group_size(99)


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu"])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("k,n,group", [(96, 37, 32), (100, 56, 100)])
def test_int4_paths_equal_definition(path, rows, k, n, group):
    """Both paths (forward_cpu: the FFI int4 kernel) on odd widths, grouped and per
    channel, equal the float64 definition of the dequantized weight."""
    from xlm.ops import cpu_kernels

    assert cpu_kernels.available()
    rng = np.random.default_rng(rows)
    kernel, scale, minimum = quantize_int4(rng.standard_normal((k, n)).astype(np.float32), group)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = np.asarray(jax.jit(getattr(QuantMatmul(), path))(x, kernel, scale, minimum))
    want = reference_matmul(x, kernel, scale, get_scheme("int4"), minimum)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
