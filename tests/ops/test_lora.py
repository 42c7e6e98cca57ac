"""The lora op's dense path equals the per-token definition x_t @ A[slot_t] @ B[slot_t]."""

from __future__ import annotations

import jax
import numpy as np

from xlm.ops.lora import LoRA


def per_token(x, a, b, slots):
    out = np.zeros((x.shape[0], b.shape[-1]), np.float64)
    for t, s in enumerate(slots):
        if s:
            out[t] = x[t].astype(np.float64) @ a[:, s - 1] @ b[s - 1]
    return out


def test_native_path_equals_per_token_definition():
    rng = np.random.default_rng(0)
    t, d_in, d_out, n, r = 37, 24, 40, 3, 4
    x = rng.standard_normal((t, d_in)).astype(np.float32)
    a = rng.standard_normal((d_in, n, r)).astype(np.float32)
    b = rng.standard_normal((n, r, d_out)).astype(np.float32)
    slots = rng.integers(0, n + 1, t).astype(np.int32)
    slots[:3] = [0, 1, n]  # none, the first slot and the last
    got = np.asarray(jax.jit(LoRA().forward_native)(x, a, b, slots))
    np.testing.assert_allclose(got, per_token(x, a, b, slots), rtol=1e-4, atol=1e-4)
    assert not got[slots == 0].any()  # no adapter: exactly nothing added


def test_one_slot_changes_only_its_tokens():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    a = rng.standard_normal((16, 2, 4)).astype(np.float32)
    b = rng.standard_normal((2, 4, 8)).astype(np.float32)
    slots = np.array([1, 2, 1, 2, 0, 0, 1, 2], np.int32)
    before = np.asarray(LoRA().forward_native(x, a, b, slots))
    b2 = b.copy()
    b2[1] *= -3.0  # rewrite slot 2 only
    after = np.asarray(LoRA().forward_native(x, a, b2, slots))
    np.testing.assert_array_equal(after[slots != 2], before[slots != 2])
    np.testing.assert_allclose(after[slots == 2], -3.0 * before[slots == 2], rtol=1e-5)


def test_fused_parts_use_only_their_own_columns():
    """A fused gate | up (2 parts, laid out per shard): the per-part product equals the
    dense product with B zero outside each part's rank block x own columns."""
    from xlm.distributed.tensor_parallel import to_physical

    rng = np.random.default_rng(2)
    t, d_in, n, r, inter = 9, 12, 2, 3, 8
    for shards in (1, 2, 4):
        x = rng.standard_normal((t, d_in)).astype(np.float32)
        a = rng.standard_normal((d_in, n, 2 * r)).astype(np.float32)
        logical = np.zeros((n, 2 * r, 2 * inter), np.float32)
        logical[:, :r, :inter] = rng.standard_normal((n, r, inter))
        logical[:, r:, inter:] = rng.standard_normal((n, r, inter))
        b = to_physical(logical, {"fused_shards": (2, shards)})
        slots = rng.integers(0, n + 1, t).astype(np.int32)
        got = np.asarray(LoRA(2, shards).forward_native(x, a, b, slots))
        want = to_physical(per_token(x, a, logical, slots), {"fused_shards": (2, shards)})
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{shards}")
