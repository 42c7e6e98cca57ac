"""The few-rows path: a step whose real rows of logits fit a tier computes the LM head on
that many rows only (the padding rows are zeros), otherwise on every row, and samples on
the few-rows sampler bucket; the real rows' logits and tokens are the same either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlm.worker.buckets import FEW_ROWS, LOGIT_ROW_TIERS, Buckets
from xlm.worker.programs import lm_head_logits


class Head:
    def __init__(self, w):
        self.w = w

    def compute_logits(self, h):
        return h @ self.w


def _tier(total: int, real: int) -> int:
    """Rows computed: the smallest tier below total that holds the real rows."""
    return next((t for t in LOGIT_ROW_TIERS if real <= t < total), total)


@pytest.mark.parametrize(
    "total,real", [(32, 1), (32, 2), (32, 8), (32, 9), (32, 32), (4, 1), (4, 3), (1, 1)]
)
def test_real_rows_equal_the_full_head(total, real):
    rng = np.random.default_rng(total + real)
    w = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((total, 16)), jnp.float32)
    got = np.asarray(jax.jit(lambda h, n: lm_head_logits(Head(w), h, n))(h, jnp.int32(real)))
    want = np.asarray(h @ w)
    assert got.shape == want.shape
    rows = _tier(total, real)
    np.testing.assert_allclose(got[:rows], want[:rows], rtol=1e-6)
    assert np.all(got[rows:] == 0)  # not computed


def test_sampler_rows_take_the_few_rows_bucket_when_few_are_real():
    buckets = Buckets((1, 8, 16, 64), (1, 2, 4, 8, 16, 32), max_num_seqs=32)
    assert buckets.sampler_rows(32, 1) == FEW_ROWS == buckets.few_rows_bucket(32)
    assert buckets.sampler_rows(32, FEW_ROWS) == FEW_ROWS
    assert buckets.sampler_rows(32, FEW_ROWS + 1) == 32
    assert buckets.sampler_rows(8, 1) == 8 and buckets.few_rows_bucket(8) is None
    assert buckets.sampler_rows(1, 1) == 1
    small = Buckets((1, 4), (1, 2, 4), max_num_seqs=4)  # no few-rows bucket below its rows
    assert small.few_rows_bucket(4) is None and small.sampler_rows(4, 1) == 4
