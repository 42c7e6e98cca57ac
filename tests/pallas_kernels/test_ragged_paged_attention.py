"""Ragged paged attention: reference vs brute force, kernels (interpret) vs reference,
lowering for CUDA and compiling for TPU topologies without the hardware."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (
    dequantize,
    kv_cache_shape,
    kv_cache_shape_tpu,
    quantize,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
    tpu_row_width,
    write_kv,
    write_kv_tpu,
)
from pallas_kernels.ragged_paged_attention.kv_quant import row_head_dim
from tests.pallas_kernels.rpa_batches import (
    Batch,
    brute_force_attention,
    case_batch,
    make_batch,
)

HEAD_DIM = 32
SM_SCALE = HEAD_DIM**-0.5

# name -> (q_lens, seq_lens, num_q_heads, num_kv_heads, block_size, padded T, padded R)
CASES = {
    "decode": ([1, 1, 1, 1, 1], [1, 17, 40, 8, 33], 4, 1, 8, 8, 7),
    "prefill": ([13, 7, 16], [13, 7, 16], 2, 2, 8, 40, 4),
    "mixed_mid_page": ([1, 9, 1, 5, 3], [17, 30, 3, 12, 3], 8, 1, 8, 24, 6),
    "mixed_gqa4_page16": ([6, 1, 11, 1], [21, 50, 11, 16], 8, 2, 16, None, None),
}


def _batch(name: str, seed: int = 0, dtype=jnp.float32) -> Batch:
    b = case_batch(CASES[name], seed, HEAD_DIM)
    if dtype != jnp.float32:
        b.q = np.asarray(jnp.asarray(b.q, dtype))
        b.kv_cache = np.asarray(jnp.asarray(b.kv_cache, dtype))
    return b


def _tol(dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- reference and write_kv


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("window,cap", [(None, None), (7, 5.0)])
def test_reference_matches_brute_force(name, window, cap):
    b = _batch(name, seed=1)
    expect = brute_force_attention(b, SM_SCALE, window, cap)
    got = jax.jit(
        functools.partial(
            ragged_paged_attention_reference, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap
        )
    )(*b.args())
    np.testing.assert_allclose(np.asarray(got), expect, rtol=1e-5, atol=1e-5)
    n_real = int(b.query_start_loc[b.num_seqs[0]])
    assert np.all(np.asarray(got)[n_real:] == 0)  # padding rows are defined as 0


def test_write_kv_scatters_into_slots_then_attention_sees_them():
    rng = np.random.default_rng(3)
    bs, hkv, d = 4, 2, 8
    cache = jnp.zeros(kv_cache_shape(6, bs, hkv, d), jnp.float32)
    assert cache.shape == (2, 6, bs, hkv, d)
    k = rng.standard_normal((5, hkv, d), np.float32)
    v = rng.standard_normal((5, hkv, d), np.float32)
    slots = np.array([3 * bs + 2, 3 * bs + 3, 5 * bs + 0, 0, 1], np.int32)  # last two: padding
    cache = np.asarray(write_kv(cache, k, v, slots))
    np.testing.assert_array_equal(cache[0, 3, 2], k[0])
    np.testing.assert_array_equal(cache[1, 5, 0], v[2])
    assert not cache[:, 1:3].any() and not cache[:, 4].any()

    # Request with context 7 on pages [3, 5] (positions 0..3 on page 3, 4..6 on page 5).
    b = make_batch(rng, [3], [7], num_q_heads=4, num_kv_heads=hkv, head_dim=d, block_size=bs)
    new_k = rng.standard_normal((3, hkv, d), np.float32)
    new_v = rng.standard_normal((3, hkv, d), np.float32)
    pages = b.block_tables[0]
    slots = np.array([pages[(p // bs)] * bs + p % bs for p in (4, 5, 6)], np.int32)
    b.kv_cache = np.asarray(write_kv(b.kv_cache, new_k, new_v, slots))
    got = ragged_paged_attention_reference(*b.args(), sm_scale=0.5)
    np.testing.assert_allclose(np.asarray(got), brute_force_attention(b, 0.5), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- kernels in interpret mode


def _to_tpu_layout(kv_cache):
    """(2, NB, BS, Hkv, row) shared layout -> the TPU layout: heads before positions, rows
    padded with zeros to `tpu_row_width` (128 lanes for this file's 32-wide heads)."""
    cache = jnp.asarray(kv_cache).transpose(0, 1, 3, 2, 4)
    width = tpu_row_width(row_head_dim(cache.shape[-1], cache.dtype), cache.dtype)
    return jnp.pad(cache, ((0, 0),) * 4 + ((0, width - cache.shape[-1]),))


def _check_kernel(kernel, b: Batch, dtype, window=None, cap=None, tol=None, **knobs):
    args = [jnp.asarray(a) for a in b.args()]
    expect = ragged_paged_attention_reference(
        *args, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap
    )
    if kernel is ragged_paged_attention_tpu:
        args[1] = _to_tpu_layout(args[1])
    got = kernel(
        *args, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap, interpret=True, **knobs
    )
    assert got.shape == b.q.shape and got.dtype == dtype
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(expect.astype(jnp.float32)), **(tol or _tol(dtype)))


GPU_CASES = [
    # (case, dtype, sliding_window, soft_cap, knobs)
    ("decode", jnp.float32, None, None, {}),  # default knobs: block_q=1, kv splits
    ("decode", jnp.bfloat16, 9, 30.0, dict(block_kv=16)),
    ("prefill", jnp.float32, None, None, dict(block_kv=16)),
    ("prefill", jnp.float32, 6, None, dict(block_q=4, block_kv=16, num_kv_splits=2)),
    ("mixed_mid_page", jnp.float32, 7, 5.0, dict(block_kv=16)),
    ("mixed_mid_page", jnp.bfloat16, None, None, dict(block_q=3, num_kv_splits=3)),
    ("mixed_gqa4_page16", jnp.float32, None, 5.0, dict(block_q=2, block_kv=32)),
]


@pytest.mark.parametrize("name,dtype,window,cap,knobs", GPU_CASES)
def test_gpu_kernel_interpret(name, dtype, window, cap, knobs):
    _check_kernel(
        ragged_paged_attention_gpu, _batch(name, dtype=dtype), dtype, window, cap, **knobs
    )


def test_gpu_kernel_interpret_random_batches():
    rng = np.random.default_rng(7)
    for _ in range(2):
        n = int(rng.integers(1, 5))
        q_lens = [int(x) for x in rng.choice([1, 1, 2, 5, 12], size=n)]
        seq_lens = [q + int(rng.integers(0, 30)) for q in q_lens]
        hkv = int(rng.choice([1, 2]))
        b = make_batch(
            rng,
            q_lens,
            seq_lens,
            num_q_heads=hkv * int(rng.choice([1, 4, 8])),
            num_kv_heads=hkv,
            head_dim=HEAD_DIM,
            block_size=int(rng.choice([4, 8])),
            num_tokens=sum(q_lens) + 3,
            num_reqs=n + 1,
        )
        _check_kernel(
            ragged_paged_attention_gpu,
            b,
            jnp.float32,
            window=None,
            cap=None,
            block_q=int(rng.choice([1, 4])),
            block_kv=16,
        )


TPU_CASES = [
    # (case, dtype, sliding_window, soft_cap, knobs); block_q * group % (8 f32, 16 bf16) == 0
    ("decode", jnp.float32, None, None, {}),  # default knobs
    ("decode", jnp.bfloat16, 9, 30.0, dict(pages_per_tile=2)),
    ("prefill", jnp.float32, 6, None, dict(block_q=8, pages_per_tile=1)),
    ("mixed_mid_page", jnp.float32, 7, 5.0, dict(block_q=1, pages_per_tile=2)),
    ("mixed_mid_page", jnp.bfloat16, None, None, dict(block_q=2)),
    ("mixed_gqa4_page16", jnp.float32, None, 5.0, dict(block_q=2, pages_per_tile=1)),
]


@pytest.mark.parametrize("name,dtype,window,cap,knobs", TPU_CASES)
def test_tpu_kernel_interpret(name, dtype, window, cap, knobs):
    _check_kernel(
        ragged_paged_attention_tpu, _batch(name, dtype=dtype), dtype, window, cap, **knobs
    )


def test_write_kv_tpu_matches_shared_layout():
    rng = np.random.default_rng(5)
    k = rng.standard_normal((6, 2, 8), np.float32)
    v = rng.standard_normal((6, 2, 8), np.float32)
    slots = np.array([5, 6, 7, 8, 17, 2], np.int32)
    shared = write_kv(jnp.zeros(kv_cache_shape(5, 4, 2, 8)), k, v, slots)
    tpu = write_kv_tpu(jnp.zeros(kv_cache_shape_tpu(5, 4, 2, 8)), k, v, slots)
    assert tpu.shape == (2, 5, 2, 4, 128)  # 8-wide rows padded to the 128 lanes
    np.testing.assert_array_equal(np.asarray(_to_tpu_layout(shared)), np.asarray(tpu))


def test_tpu_kernel_rejects_untileable_block_q():
    b = _batch("mixed_gqa4_page16")
    args = [jnp.asarray(a) for a in b.args()]
    args[1] = _to_tpu_layout(args[1])
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention_tpu(*args, sm_scale=SM_SCALE, block_q=1, interpret=True)


# ---------------------------------------------------------------- lowering without hardware


def _abstract_args(dtype, t=64, r=8, hq=32, hkv=8, d=128, num_blocks=64, bs=16, max_blocks=16):
    s = jax.ShapeDtypeStruct
    return (
        s((t, hq, d), dtype),
        s(kv_cache_shape(num_blocks, bs, hkv, d), dtype),
        s((r, max_blocks), jnp.int32),
        s((r,), jnp.int32),
        s((r + 1,), jnp.int32),
        s((1,), jnp.int32),
    )


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_lowers_for_cuda(splits, dtype):
    f = functools.partial(
        ragged_paged_attention_gpu,
        sm_scale=0.1,
        sliding_window=64,
        soft_cap=30.0,
        num_kv_splits=splits,
    )
    text = jax.jit(f).trace(*_abstract_args(dtype)).lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_paged_attention_gpu" in text


def test_gpu_kernel_lowers_an_int8_cache_for_cuda():
    args = list(_abstract_args(jnp.bfloat16))
    args[1] = jax.ShapeDtypeStruct(kv_cache_shape(64, 16, 8, 128, jnp.int8), jnp.int8)
    f = functools.partial(ragged_paged_attention_gpu, sm_scale=0.1, num_kv_splits=2)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_paged_attention_gpu" in text


def _libtpu_installed() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


needs_libtpu = pytest.mark.skipif(
    not _libtpu_installed(),
    reason="libtpu not installed (pip install -e '.[test]' brings it): deviceless TPU compile",
)


@functools.cache
def _tpu_topology_mesh(topology_name: str) -> jax.sharding.Mesh:
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
    return jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))


# Every pair of values of the four factors (chip generation, dtype, window and cap, decode or
# prefill knobs: `default_knobs_tpu` reads only shapes and dtype) compiled together at least
# once: 6 compiles where the full product is 24, each factor's every value on each chip.
TPU_COMPILES = [
    # (topology, dtype, (window, cap), (num_tokens, num_reqs)): (8, 8) decode, (256, 8) prefill
    ("v5e:2x2", jnp.bfloat16, (None, None), (8, 8)),
    ("v5e:2x2", jnp.float32, (64, 30.0), (256, 8)),
    ("v6e:2x2", jnp.bfloat16, (64, 30.0), (256, 8)),
    ("v6e:2x2", jnp.float32, (None, None), (8, 8)),
    ("v5p:2x2x1", jnp.bfloat16, (None, None), (256, 8)),
    ("v5p:2x2x1", jnp.float32, (64, 30.0), (8, 8)),
]


@needs_libtpu
@pytest.mark.parametrize("topology_name,dtype,window_cap,tokens_reqs", TPU_COMPILES)
def test_tpu_kernel_compiles_for_tpu(topology_name, dtype, window_cap, tokens_reqs):
    # libtpu compiles for a TPU topology without a TPU attached: Mosaic's lowering (block
    # tiling checks) and its compile to TPU code both run, under the topology's mesh.
    (window, cap), (num_tokens, num_reqs) = window_cap, tokens_reqs
    s = jax.ShapeDtypeStruct
    t, r, hq, hkv, d, num_blocks, bs, max_blocks = num_tokens, num_reqs, 32, 8, 128, 64, 16, 16
    mesh = _tpu_topology_mesh(topology_name)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = tuple(
        s(shape, dt, sharding=sharding)
        for shape, dt in [
            ((t, hq, d), dtype),
            (kv_cache_shape_tpu(num_blocks, bs, hkv, d), dtype),
            ((r, max_blocks), jnp.int32),
            ((r,), jnp.int32),
            ((r + 1,), jnp.int32),
            ((1,), jnp.int32),
        ]
    )
    f = functools.partial(
        ragged_paged_attention_tpu, sm_scale=0.1, sliding_window=window, soft_cap=cap
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(f).trace(*args).lower().compile()
    assert "tpu_custom_call" in compiled.as_text()
    assert compiled.output_shardings.device_set == set(mesh.devices.flat)
    memory = compiled.memory_analysis()
    q_bytes = t * hq * d * jnp.dtype(dtype).itemsize
    assert memory.output_size_in_bytes == q_bytes  # the output has the query's shape


@needs_libtpu
@pytest.mark.parametrize("num_tokens,num_reqs", [(8, 8), (256, 8)])
def test_tpu_kernel_compiles_an_int8_cache_for_tpu(num_tokens, num_reqs):
    """Mosaic takes the int8 cache's rows (codes, then the scale's bytes, padded to the 128
    lanes: `tpu_row_width`) and decodes the scale in the kernel, so head_dim 64 costs half
    bfloat16's bytes (whose 64-lane rows are padded too)."""
    s = jax.ShapeDtypeStruct
    t, r, hq, hkv, nb, bs, max_blocks = num_tokens, num_reqs, 12, 4, 64, 16, 16
    mesh = _tpu_topology_mesh("v6e:2x2")
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    cache_bytes = {}
    for d, kv_dtype in [(64, jnp.int8), (64, jnp.bfloat16)]:
        args = tuple(
            s(shape, dt, sharding=sharding)
            for shape, dt in [
                ((t, hq, d), jnp.bfloat16),
                (kv_cache_shape_tpu(nb, bs, hkv, d, kv_dtype), kv_dtype),
                ((r, max_blocks), jnp.int32),
                ((r,), jnp.int32),
                ((r + 1,), jnp.int32),
                ((1,), jnp.int32),
            ]
        )
        f = functools.partial(ragged_paged_attention_tpu, sm_scale=0.1)
        with jax.set_mesh(mesh):
            compiled = jax.jit(f).trace(*args).lower().compile()
        assert "tpu_custom_call" in compiled.as_text()
        cache_bytes[kv_dtype] = compiled.memory_analysis().argument_size_in_bytes
    # Only the cache differs: bfloat16's 64-lane rows take 128 lanes * 2 bytes, int8's 128 * 1.
    padded_bf16_cache = 2 * nb * hkv * bs * 128 * 2
    assert cache_bytes[jnp.bfloat16] - cache_bytes[jnp.int8] >= 0.45 * padded_bf16_cache


# ---------------------------------------------------------------- real hardware


def _has(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype,window,cap,knobs", GPU_CASES[:4])
def test_gpu_kernel_on_device(name, dtype, window, cap, knobs):
    if not _has("gpu"):
        pytest.skip("no GPU device")
    b = _batch(name, dtype=dtype)
    args = [jnp.asarray(a) for a in b.args()]
    expect = ragged_paged_attention_reference(
        *args, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap
    )
    got = ragged_paged_attention_gpu(
        *args, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap, **knobs
    )
    # f32 dots on GPU may use TF32-free IEEE but accumulate in another order: looser atol.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == jnp.float32 else _tol(dtype)
    np.testing.assert_allclose(
        np.asarray(got.astype(jnp.float32)), np.asarray(expect.astype(jnp.float32)), **tol
    )


@pytest.mark.tpu
@pytest.mark.parametrize("name,dtype,window,cap,knobs", TPU_CASES)
def test_tpu_kernel_on_device(name, dtype, window, cap, knobs):
    if not _has("tpu"):
        pytest.skip("no TPU device")
    b = _batch(name, dtype=dtype)
    args = [jnp.asarray(a) for a in b.args()]
    expect = ragged_paged_attention_reference(
        *args, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap
    )
    args[1] = _to_tpu_layout(args[1])
    got = ragged_paged_attention_tpu(
        *args, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap, **knobs
    )
    # The MXU runs f32 matmuls in bf16 passes at default precision: compare loosely.
    np.testing.assert_allclose(
        np.asarray(got.astype(jnp.float32)),
        np.asarray(expect.astype(jnp.float32)),
        rtol=2e-2,
        atol=2e-2,
    )


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_read_an_fp8_cache(kernel, q_dtype):
    """--kv-cache-dtype fp8: the kernels widen each page as they read it, like the
    reference (which reads the same float8 values)."""
    b = _batch("mixed_mid_page", dtype=q_dtype)
    b.kv_cache = np.asarray(write_kv(jnp.zeros(b.kv_cache.shape, jnp.float8_e4m3fn), *_kv(b)))
    assert b.kv_cache.dtype == jnp.float8_e4m3fn
    fn = ragged_paged_attention_gpu if kernel == "gpu" else ragged_paged_attention_tpu
    knobs = dict(block_kv=16) if kernel == "gpu" else dict(block_q=2)
    _check_kernel(fn, b, q_dtype, **knobs)


def _int8_batch(q_dtype):
    """`mixed_mid_page` with every slot of an int8 cache written (rows of codes + scale)."""
    b = _batch("mixed_mid_page", dtype=q_dtype)
    _, nb, bs, hkv, d = b.kv_cache.shape
    cache = jnp.zeros(kv_cache_shape(nb, bs, hkv, d, jnp.int8), jnp.int8)
    assert cache.shape == (2, nb, bs, hkv, d + 4)
    b.kv_cache = np.asarray(write_kv(cache, *_kv(b)))
    return b


def test_int8_rows_round_trip_within_half_a_step():
    """--kv-cache-dtype int8: a row's codes times its scale (max|row| / 127) is the row to
    within half a quantization step; the kernels' byte arithmetic decodes the same scale
    as a bitcast; an all-zero row stays zero (no 0 / 0)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((6, 3, HEAD_DIM)).astype(np.float32) * 5).at[0, 0].set(0)
    rows = quantize(x, jnp.int8)
    assert rows.shape == (6, 3, HEAD_DIM + 4) and rows.dtype == jnp.int8
    step = np.abs(np.asarray(x)).max(-1, keepdims=True) / 127
    got = np.asarray(dequantize(rows, jnp.float32))
    assert (np.abs(got - np.asarray(x)) <= step / 2 + 1e-6).all()
    assert not got[0, 0].any()
    np.testing.assert_array_equal(np.asarray(dequantize(rows, jnp.float32, in_kernel=True)), got)
    # The shared and TPU writers store the same rows.
    k, v, slots = x[:3], x[3:], np.array([5, 6, 9], np.int32)
    shared = write_kv(jnp.zeros(kv_cache_shape(4, 4, 3, HEAD_DIM, jnp.int8), jnp.int8), k, v, slots)
    tpu = write_kv_tpu(
        jnp.zeros(kv_cache_shape_tpu(4, 4, 3, HEAD_DIM, jnp.int8), jnp.int8), k, v, slots
    )
    np.testing.assert_array_equal(np.asarray(_to_tpu_layout(shared)), np.asarray(tpu))


def test_reference_reads_an_int8_cache_closer_to_float_than_fp8():
    b = _batch("mixed_mid_page")
    _, nb, bs, hkv, d = b.kv_cache.shape
    outputs = {}
    for dtype in (jnp.float32, jnp.int8, jnp.float8_e4m3fn):
        cache = jnp.zeros(kv_cache_shape(nb, bs, hkv, d, dtype), dtype)
        b.kv_cache = np.asarray(write_kv(cache, *_kv(b)))
        outputs[dtype] = np.asarray(ragged_paged_attention_reference(*b.args(), sm_scale=SM_SCALE))
    int8, fp8 = (
        np.abs(outputs[t] - outputs[jnp.float32]).mean() for t in (jnp.int8, jnp.float8_e4m3fn)
    )
    assert 0 < int8 < fp8 / 2, (int8, fp8)


@pytest.mark.parametrize("kernel,q_dtype", [("gpu", jnp.float32), ("tpu", jnp.bfloat16)])
def test_kernels_read_an_int8_cache(kernel, q_dtype):
    """--kv-cache-dtype int8: the kernels split each row into codes and scale as they read
    it and match the reference on the same cache."""
    fn = ragged_paged_attention_gpu if kernel == "gpu" else ragged_paged_attention_tpu
    knobs = dict(block_kv=16) if kernel == "gpu" else dict(block_q=2)
    # bfloat16 queries: the kernel rounds codes * scale to bfloat16, the reference does not.
    tol = dict(rtol=5e-2, atol=5e-2) if q_dtype == jnp.bfloat16 else None
    _check_kernel(fn, _int8_batch(q_dtype), q_dtype, tol=tol, **knobs)


def _kv(b: Batch):
    """Every slot of `b`'s cache written once (k, v [slots, Hkv, D], slot ids)."""
    _, nb, bs, hkv, _ = b.kv_cache.shape
    d = b.q.shape[-1]
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((2, nb * bs, hkv, d)).astype(np.float32) * 3
    return kv[0], kv[1], np.arange(nb * bs, dtype=np.int32)
