"""pack/unpack: a pytree of numpy arrays crosses to the device as one int32 buffer and comes
back bit for bit inside a jitted function."""

from __future__ import annotations

import jax
import numpy as np

from xlm.worker.packing import pack, unpack


def _tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "positions": rng.integers(-(2**31), 2**31 - 1, (3, 5)).astype(np.int32),
        "temperature": np.array([rng.random(), np.inf, -0.0, np.nan, 1e-30], np.float32),
        "seeds": np.array([[0xFFFFFFFF, 0], [1, 0x80000000]], np.uint32),
        "mask": rng.integers(0, 256, 7).astype(np.uint8),  # not a multiple of four bytes
        "flags": rng.random(3) < 0.5,
        "narrow": np.array([1, -2, 3], np.int64),  # stored as int32
        "nested": [np.zeros((0, 4), np.float32), np.uint8(200)],
    }


def test_pack_then_unpack_under_jit_gives_back_every_leaf_bit_for_bit():
    tree = _tree()
    buffer, layout = pack(tree)
    assert buffer.dtype == np.int32 and buffer.ndim == 1
    # 15 + 5 + 4 + 2 words (7 bytes) + 3 + 3 + 0 + 1 word (1 byte).
    assert buffer.size == 33
    out = jax.jit(unpack, static_argnums=1)(buffer, layout)
    want_leaves, want_def = jax.tree_util.tree_flatten(tree)
    got_leaves, got_def = jax.tree_util.tree_flatten(out)
    assert got_def == want_def
    for got, want in zip(got_leaves, want_leaves, strict=True):
        got = np.asarray(got)
        assert got.shape == np.shape(want)
        if want.dtype == np.int64:
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, want)
        else:
            assert got.dtype == want.dtype
            assert got.tobytes() == np.asarray(want).tobytes()  # NaN and -0.0 included


def test_the_layout_is_static_across_equal_shapes():
    """Equal shapes and dtypes give an equal, hashable layout: one compiled program."""
    a, layout_a = pack(_tree())
    b, layout_b = pack(_tree(seed=1))
    assert layout_a == layout_b and hash(layout_a) == hash(layout_b)
    assert a.shape == b.shape and not np.array_equal(a, b)


def test_an_empty_tree_packs_to_an_empty_buffer():
    buffer, layout = pack({})
    assert buffer.shape == (0,) and unpack(buffer, layout) == {}
