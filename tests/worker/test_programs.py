"""lm_head_logits: a step whose real rows of logits fit a tier computes the LM head on that
many rows only (the padding rows are zeros), otherwise on every row; the real rows' logits
are the full head's either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlm.worker.buckets import LOGIT_ROW_TIERS
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
    # Float32 rounding only: a dot over fewer rows may sum in another order.
    np.testing.assert_allclose(got[:rows], want[:rows], rtol=1e-5, atol=1e-5)
    assert np.all(got[rows:] == 0)  # not computed
