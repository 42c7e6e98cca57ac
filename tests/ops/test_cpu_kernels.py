"""The CPU paged-attention kernel (xlm.ops.cpu_kernels.paged_attention) against the
brute-force float64 attention of tests/pallas_kernels: decode, prefill and mixed batches,
GQA groups, sliding windows and soft caps, padding rows, random ragged batches; inside jit
and under vmap-free shapes the engine uses; shape errors before tracing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.pallas_kernels.rpa_batches import brute_force_attention, make_batch
from tests.pallas_kernels.rpa_batches import case_batch as rpa_case_batch
from xlm.ops import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler")

HEAD_DIM = 64
SM_SCALE = HEAD_DIM**-0.5

# name -> (q_lens, seq_lens, num_q_heads, num_kv_heads, block_size, padded T, padded R)
CASES = {
    "decode": ([1, 1, 1, 1, 1], [1, 17, 40, 8, 33], 9, 3, 16, 8, 7),
    "prefill": ([13, 7, 30], [13, 7, 30], 4, 2, 8, 64, 4),
    "mixed_mid_page": ([1, 9, 1, 5, 3], [17, 30, 3, 12, 3], 8, 1, 8, 24, 6),
    "chunked_prefill_long": ([20, 1], [300, 301], 6, 2, 16, 32, 4),
}


def case_batch(name: str, seed: int):
    return rpa_case_batch(CASES[name], seed, HEAD_DIM)


def run(b, window=None, cap=None, max_workers=0):
    fn = jax.jit(
        lambda *a: cpu_kernels.paged_attention(
            *a, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap, max_workers=max_workers
        )
    )
    return np.asarray(fn(*b.args()))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("window,cap", [(None, None), (7, 5.0), (100, None)])
def test_kernel_matches_brute_force(name, window, cap):
    b = case_batch(name, seed=3)
    got = run(b, window, cap)
    np.testing.assert_allclose(got, brute_force_attention(b, SM_SCALE, window, cap), atol=2e-5)
    n_real = int(b.query_start_loc[b.num_seqs[0]])
    assert np.all(got[n_real:] == 0)  # padding rows are zero, as the reference defines


def test_random_ragged_batches_on_one_and_all_threads():
    rng = np.random.default_rng(11)
    for _ in range(6):
        n = int(rng.integers(1, 9))
        q_lens = [int(x) for x in rng.choice([1, 1, 1, 3, 17, 40], size=n)]
        seq_lens = [q + int(rng.integers(0, 200)) for q in q_lens]
        hkv = int(rng.choice([1, 2, 4]))
        b = make_batch(
            rng,
            q_lens,
            seq_lens,
            num_q_heads=hkv * int(rng.choice([1, 3, 8])),
            num_kv_heads=hkv,
            head_dim=int(rng.choice([32, 64, 80])),
            block_size=int(rng.choice([4, 16, 32])),
            num_tokens=sum(q_lens) + 5,
            num_reqs=n + 2,
        )
        scale = b.q.shape[-1] ** -0.5
        want = brute_force_attention(b, scale)
        for workers in (1, 0):
            got = np.asarray(
                jax.jit(
                    lambda *a, w=workers, sc=scale: cpu_kernels.paged_attention(
                        *a, sm_scale=sc, max_workers=w
                    )
                )(*b.args())
            )
            np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "dtype", "match"),
    [
        ((4, 8, 64), (2, 5, 16, 3, 64), np.float32, "multiple of the KV heads"),
        ((4, 8, 32), (2, 5, 16, 2, 64), np.float32, "disagree on head_dim"),
        ((4, 8), (2, 5, 16, 2, 64), np.float32, r"q must be \[T, Hq, D\]"),
        ((4, 8, 64), (2, 5, 16, 2, 64), np.float16, "must be float32"),
    ],
)
def test_bad_shapes_raise_before_tracing(q_shape, kv_shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        cpu_kernels.paged_attention(
            np.zeros(q_shape, dtype),
            np.zeros(kv_shape, dtype),
            np.zeros((2, 3), np.int32),
            np.ones(2, np.int32),
            np.array([0, 1, 2], np.int32),
            np.array([2], np.int32),
            sm_scale=1.0,
        )


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "int8"])
def test_narrow_caches_read_like_the_reference(cache_dtype):
    """bfloat16, fp8 and int8-with-scales caches (written by the shared quantize rule) are
    widened as read: the kernel equals the jnp reference reading the same cache."""
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import (
        quantize,
        ragged_paged_attention_reference,
    )

    b = case_batch("mixed_mid_page", seed=5)
    cache = quantize(jnp.asarray(b.kv_cache), jnp.dtype(cache_dtype))
    args = (b.q, cache, *b.args()[2:])
    want = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=SM_SCALE))(*args)
    got = jax.jit(lambda *a: cpu_kernels.paged_attention(*a, sm_scale=SM_SCALE))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    # The narrowing moved the result: a kernel reading the float cache would fail here.
    exact = brute_force_attention(b, SM_SCALE)
    assert np.abs(np.asarray(want) - exact).max() > 1e-4
