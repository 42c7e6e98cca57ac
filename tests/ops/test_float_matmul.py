"""The few-rows float matmul: the CPU kernel (xlm.ops.cpu_kernels.float_matmul) against
numpy in float64, its AVX2 and portable paths, and the FloatMatmul op's dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlm.ops import FloatMatmul, cpu_kernels
from xlm.ops.float_matmul import FLOAT_KERNEL_MAX_ROWS, HALF_KERNEL_MAX_ROWS

rng = np.random.default_rng(0)
DTYPES = ["float32", "float16", "bfloat16"]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not cpu_kernels.available():
        pytest.skip("the CPU kernel could not be built here (no C++ compiler?)")


def make(m: int, k: int, n: int, dtype: str, transposed: bool) -> tuple[jax.Array, jax.Array]:
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), dtype)
    return x, w


def assert_close(y: jax.Array, x: jax.Array, w: jax.Array, transposed: bool) -> None:
    """float32 sums of the widened weights: error bounded by the terms' magnitudes."""
    xs, ws = np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    if transposed:
        ws = ws.T
    ref, magnitude = xs @ ws, np.abs(xs) @ np.abs(ws)
    assert y.dtype == jnp.float32 and y.shape == ref.shape
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert np.all(err <= 2e-6 * magnitude + 1e-30), float(np.max(err / magnitude))


# Odd shapes (k and n not multiples of 8 or 32; 53: 32 + 16 + 5, every step of the
# AVX-512 streaming loop), a SmolLM2 projection, a tail of columns.
SHAPES = [(37, 101), (100, 3), (53, 9), (576, 960), (577, 70)]


# 1-8: the streaming loops; 9 and more: the packed tiles, rows in near-equal groups of up
# to 12 (AVX-512; 15: 8 + 7, 23: 12 + 11, 64: 4 x 11 + 2 x 10) or 6 (AVX2).
@pytest.mark.parametrize("m", [1, 3, 8, 9, 15, 23, 64])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("scalar", [False, True])
def test_matches_float64_reference(m, k, n, dtype, transposed, scalar) -> None:
    x, w = make(m, k, n, dtype, transposed)
    call = jax.jit(
        lambda x, w: cpu_kernels.float_matmul(x, w, transposed=transposed, scalar=scalar)
    )
    assert_close(call(x, w), x, w, transposed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_the_jnp_reference(dtype) -> None:
    x, w = make(4, 300, 129, dtype, False)
    got = np.asarray(cpu_kernels.float_matmul(x, w))
    want = np.asarray(cpu_kernels.float_matmul_reference(x, w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("max_workers", [1, 2])
@pytest.mark.parametrize("m", [3, 40])
@pytest.mark.parametrize("transposed", [False, True])
def test_thread_count_does_not_change_the_result(max_workers, m, transposed) -> None:
    x, w = make(m, 576, 3072, "bfloat16", transposed)
    kw = {"transposed": transposed}
    one = cpu_kernels.float_matmul(x, w, max_workers=1, **kw)
    many = cpu_kernels.float_matmul(x, w, max_workers=max_workers, **kw)
    np.testing.assert_array_equal(one, many)


def test_half_specials_widen_exactly() -> None:
    """Subnormal, zero, negative zero, large and infinite halves widen as numpy's."""
    values = np.array([6e-8, 1e-5, 0.0, -0.0, -2.5, 65504.0, np.inf, 3.0], np.float16)
    w = jnp.asarray(np.diag(values))  # y = x * w[i, i] per column: each weight alone
    x = jnp.ones((1, 8), jnp.float32)
    for scalar in (False, True):
        y = np.asarray(cpu_kernels.float_matmul(x, w, scalar=scalar))[0]
        np.testing.assert_array_equal(y, values.astype(np.float32))


def test_bad_shapes_raise_before_tracing() -> None:
    with pytest.raises(ValueError, match="k=4"):
        cpu_kernels.float_matmul(jnp.ones((1, 5)), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.float_matmul(jnp.ones((1, 4)), jnp.ones((4, 3), jnp.int8))


def _custom_calls(fn, *args) -> int:
    return jax.jit(lambda *a: fn(*a)).lower(*args).as_text().count("xlm_float_")


def test_op_takes_the_kernel_for_half_weights_and_few_rows(monkeypatch) -> None:
    op = FloatMatmul(enforce_enable=True)
    if op._forward_name != "forward_cpu":
        pytest.skip("not on CPU")
    x, w = make(FLOAT_KERNEL_MAX_ROWS, 64, 40, "bfloat16", False)
    assert _custom_calls(op, x, w) == 1
    x_batch = jnp.ones((FLOAT_KERNEL_MAX_ROWS + 1, 64), jnp.float32)
    assert _custom_calls(op, x_batch, w) == 1  # half weights: a batch too
    x_many = jnp.ones((HALF_KERNEL_MAX_ROWS + 1, 64), jnp.float32)
    assert _custom_calls(op, x_many, w) == 0  # a long prefill: XLA's dot
    w32 = w.astype(jnp.float32)
    assert _custom_calls(op, x, w32) == 1  # float32 through the kernel: 1-8 rows
    assert _custom_calls(op, x_batch, w32) == 0
    assert op.prefers_out_major(jnp.float32) and op.prefers_out_major(jnp.bfloat16)
    monkeypatch.setattr(FloatMatmul, "float32_kernel", False)  # XLA's dot, [in, out]
    assert _custom_calls(op, x, w32) == 0
    assert not op.prefers_out_major(jnp.float32) and op.prefers_out_major(jnp.bfloat16)
    monkeypatch.setattr(FloatMatmul, "float32_kernel", True)
    # Both paths agree with the native one, which widens the kernel in XLA.
    for rows, weights in ((x, w), (x, w32), (x_batch, w)):
        np.testing.assert_allclose(
            op(rows, weights), op.forward_native(rows, weights), rtol=1e-5, atol=1e-5
        )
    head = jnp.asarray(rng.standard_normal((50, 64)), jnp.float16)
    for rows in (x, jnp.asarray(rng.standard_normal((20, 64)), jnp.float32)):
        logits = op(rows, head, transposed=True)
        assert logits.dtype == jnp.float32
        np.testing.assert_allclose(
            logits, op.forward_native(rows, head, transposed=True), rtol=1e-5, atol=1e-5
        )
