"""The LM head over a step's gathered rows: with few real rows only FEW_LOGIT_ROWS are
computed (the padding rows are zeros), otherwise every row; the real rows' logits are the
same either way, whichever branch the step's row count picks at run time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlm.worker.model_runner import FEW_LOGIT_ROWS, _logits


class Head:
    def __init__(self, w):
        self.w = w

    def compute_logits(self, h):
        return h @ self.w


@pytest.mark.parametrize("total,real", [(32, 1), (32, 8), (32, 9), (32, 32), (4, 3)])
def test_real_rows_equal_the_full_head(total, real):
    rng = np.random.default_rng(total + real)
    w = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((total, 16)), jnp.float32)
    got = np.asarray(jax.jit(lambda h, n: _logits(Head(w), h, n))(h, jnp.int32(real)))
    want = np.asarray(h @ w)
    assert got.shape == want.shape
    np.testing.assert_allclose(got[:real], want[:real], rtol=1e-6)
    if total > FEW_LOGIT_ROWS and real <= FEW_LOGIT_ROWS:
        assert np.all(got[FEW_LOGIT_ROWS:] == 0)  # not computed
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6)
