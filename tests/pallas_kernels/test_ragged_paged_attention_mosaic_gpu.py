"""The Mosaic GPU (Hopper) ragged paged attention kernel: Mosaic GPU's CPU interpreter against
the reference on the Triton kernel's cases, argument checks, Mosaic GPU's lowering for CUDA,
a deviceless compile for an H100 (sm_90a, ptxas included) with JAX's CUDA plugin, and the
reference on a real Hopper GPU."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (
    choose_gpu_kernel,
    kv_cache_shape,
    ragged_paged_attention_mosaic_gpu,
    ragged_paged_attention_reference,
    write_kv,
)
from tests.pallas_kernels.rpa_batches import make_batch
from tests.pallas_kernels.test_ragged_paged_attention import (
    GPU_CASES,
    HEAD_DIM,
    SM_SCALE,
    _batch,
    _has,
    _kv,
    _tol,
)

# The Triton kernel's cases (batches, dtypes, window, cap), with its knobs less block_kv: the
# Triton tiles (16, 32) are below this kernel's smallest (64, wgmma's row count).
MOSAIC_GPU_CASES = [
    (name, dtype, window, cap, {k: v for k, v in knobs.items() if k != "block_kv"})
    for name, dtype, window, cap, knobs in GPU_CASES
]


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """The interpreter's traced and compiled programs are many and large: released after
    this module so that the worker process running the rest of the suite does not keep
    them (a worker process died late in one suite run, cause not found; memory is one)."""
    yield
    jax.clear_caches()


@pytest.fixture
def interpreter():
    """Mosaic GPU's interpreter keeps global state that a failed kernel leaves dirty."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    yield
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _check(b, dtype, window=None, cap=None, tol=None, interpret=True, **knobs):
    args = [jnp.asarray(a) for a in b.args()]
    expect = ragged_paged_attention_reference(
        *args, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap
    )
    got = ragged_paged_attention_mosaic_gpu(
        *args, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap, interpret=interpret, **knobs
    )
    assert got.shape == b.q.shape and got.dtype == dtype
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(expect.astype(jnp.float32)), **(tol or _tol(dtype)))


# ---------------------------------------------------------------- interpret mode


# The interpreter runs each program's copies, barriers and shared-memory accesses as host
# callbacks: 4-10 s a case on CI's cores, hence `slow`.
@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,window,cap,knobs", MOSAIC_GPU_CASES)
def test_mosaic_gpu_kernel_interpret(interpreter, name, dtype, window, cap, knobs):
    _check(_batch(name, dtype=dtype), dtype, window, cap, **knobs)


@pytest.mark.slow
def test_mosaic_gpu_kernel_interpret_reads_an_fp8_cache(interpreter):
    """--kv-cache-dtype fp8: each tile is widened in registers before the tensor cores."""
    b = _batch("mixed_mid_page", dtype=jnp.bfloat16)
    b.kv_cache = np.asarray(write_kv(jnp.zeros(b.kv_cache.shape, jnp.float8_e4m3fn), *_kv(b)))
    _check(b, jnp.bfloat16, window=7)


def _long_batch(dtype):
    """Contexts of up to four 64-token tiles (the cases above fit in one), pages of 16."""
    q_lens, seq_lens = [1, 5, 12, 1], [140, 9, 75, 200]
    b = make_batch(
        np.random.default_rng(11),
        q_lens,
        seq_lens,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=HEAD_DIM,
        block_size=16,
        num_tokens=sum(q_lens) + 3,
        num_reqs=len(q_lens) + 2,
    )
    b.q = np.asarray(jnp.asarray(b.q, dtype))
    return b


LONG_KNOBS = dict(block_q=8, num_kv_splits=2, num_stages=3)


@pytest.mark.slow
def test_mosaic_gpu_kernel_interpret_pipelines_long_contexts(interpreter):
    """The online softmax across tiles, a three-buffer copy ring and two kv splits, with the
    interpreter's race detector on (a tile copied into a buffer still being read fails)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    params = InterpretGPUParams(detect_races=True)
    _check(_long_batch(jnp.float32), jnp.float32, 100, 20.0, interpret=params, **LONG_KNOBS)
    assert not interpret_pallas_call.get_races().races_found


# ---------------------------------------------------------------- argument checks


def _args(kv_dtype=jnp.bfloat16, head_dim=HEAD_DIM, block_size=16, q_dtype=jnp.bfloat16):
    b = _batch("mixed_gqa4_page16")
    nb, hkv = b.kv_cache.shape[1], b.kv_cache.shape[3]
    q = jnp.zeros((*b.q.shape[:2], head_dim), q_dtype)
    cache = jnp.zeros(kv_cache_shape(nb * 16 // block_size, block_size, hkv, head_dim, kv_dtype))
    return (q, cache.astype(kv_dtype), *map(jnp.asarray, b.args()[2:]))


@pytest.mark.parametrize(
    "kwargs,knobs,error,match",
    [
        (dict(kv_dtype=jnp.int8), {}, NotImplementedError, "int8"),
        (dict(block_size=4), {}, NotImplementedError, "block_size=4"),
        (dict(head_dim=40), {}, NotImplementedError, "head_dim=40"),
        ({}, dict(block_kv=16), ValueError, "block_kv=16"),
        ({}, dict(block_kv=48), ValueError, "block_kv=48"),
        ({}, dict(block_q=32), ValueError, "block_q=32"),
        (dict(q_dtype=jnp.float32, kv_dtype=jnp.float32, head_dim=256), {}, ValueError, "shared"),
    ],
)
def test_mosaic_gpu_kernel_rejects(kwargs, knobs, error, match):
    with pytest.raises(error, match=match):
        ragged_paged_attention_mosaic_gpu(*_args(**kwargs), sm_scale=0.1, **knobs)


def _config(*args, **knobs):
    from pallas_kernels.ragged_paged_attention.mosaic_gpu_plan import make_config

    defaults = dict(sliding_window=None, soft_cap=None, interpret=False, block_q=None)
    defaults.update(block_kv=None, num_kv_splits=None, num_stages=None)
    return make_config(*args[:3], sm_scale=0.1, **{**defaults, **knobs})


def test_float32_caches_drop_to_one_stage_where_two_do_not_fit():
    from pallas_kernels.ragged_paged_attention.mosaic_gpu_plan import SMEM_BYTES, smem_bytes

    c = _config(*_args(jnp.float32, 128, q_dtype=jnp.float32))
    assert (c.num_stages, c.q_parts, c.kv_parts, c.direct) == (1, 3, 3, False)
    assert smem_bytes(c) <= SMEM_BYTES
    c = _config(*_args(jnp.float8_e4m3fn, 128, q_dtype=jnp.float32))
    assert (c.num_stages, c.q_parts, c.kv_parts, c.direct) == (2, 3, 1, False)
    c = _config(*_args(jnp.bfloat16, 128))
    assert (c.num_stages, c.q_parts, c.kv_parts, c.direct) == (2, 1, 1, True)
    with pytest.raises(ValueError, match="num_stages=2"):
        _config(*_args(jnp.float32, 128, q_dtype=jnp.float32), num_stages=2)


@pytest.mark.parametrize(
    "jax_version,capability,kernel",
    [
        ("0.11.0", "9.0", "mosaic_gpu"),
        ("0.11.1.dev20260301", "10.0", "mosaic_gpu"),
        ("0.12.0rc1", (12, 0), "mosaic_gpu"),
        ((0, 11, 0), "9.0", "mosaic_gpu"),
        ("0.10.2", "9.0", "triton"),
        ("0.11.0", "8.9", "triton"),
        ("0.11.0", "8.0", "triton"),
        ("1.0.0", (7, 5), "triton"),
    ],
)
def test_choose_gpu_kernel(jax_version, capability, kernel):
    assert choose_gpu_kernel(jax_version, capability) == kernel


def test_choose_gpu_kernel_rejects_a_non_version():
    with pytest.raises(ValueError, match="jax_version='dev'"):
        choose_gpu_kernel("dev", "9.0")


# ---------------------------------------------------------------- lowering without hardware


def _abstract_args(dtype, kv_dtype=None, t=64, r=8, hq=32, hkv=8, d=128, sharding=None):
    s = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    num_blocks, bs, max_blocks = 64, 16, 16
    kv_dtype = kv_dtype or dtype
    return (
        s((t, hq, d), dtype),
        s(kv_cache_shape(num_blocks, bs, hkv, d, kv_dtype), kv_dtype),
        s((r, max_blocks), jnp.int32),
        s((r,), jnp.int32),
        s((r + 1,), jnp.int32),
        s((1,), jnp.int32),
    )


# (query dtype, cache dtype, (window, cap), (num_tokens, num_reqs), knobs): every path of the
# kernel (direct bfloat16 tiles, float32 in three parts, fp8 widened, kv splits) once.
LOWERINGS = [
    (jnp.bfloat16, None, (None, None), (8, 8), {}),
    (jnp.bfloat16, None, (64, 30.0), (256, 8), {}),
    (jnp.float32, None, (64, 30.0), (64, 8), dict(num_kv_splits=2)),
    (jnp.bfloat16, jnp.float8_e4m3fn, (None, None), (8, 8), {}),
    (jnp.float32, jnp.float8_e4m3fn, (None, 30.0), (64, 8), {}),
]


@pytest.mark.parametrize("dtype,kv_dtype,window_cap,tokens_reqs,knobs", LOWERINGS)
def test_mosaic_gpu_kernel_lowers_for_cuda(dtype, kv_dtype, window_cap, tokens_reqs, knobs):
    """Mosaic GPU's own lowering (layouts, wgmma and TMA shapes, shared memory) runs in
    Python at jax's lowering, no GPU or CUDA plugin needed."""
    (window, cap), (t, r) = window_cap, tokens_reqs
    f = functools.partial(
        ragged_paged_attention_mosaic_gpu, sm_scale=0.1, sliding_window=window, soft_cap=cap
    )
    args = _abstract_args(dtype, kv_dtype, t=t, r=r)
    text = jax.jit(functools.partial(f, **knobs)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in text.as_text()


def _cuda_plugin() -> bool:
    return importlib.util.find_spec("jax_plugins") is not None and any(
        importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13)
    )


@pytest.mark.skipif(
    not _cuda_plugin(), reason="needs JAX's CUDA plugin (jax_plugins.xla_cuda12 or xla_cuda13)"
)
@pytest.mark.parametrize("dtype,kv_dtype,window_cap,tokens_reqs,knobs", LOWERINGS[1:4])
def test_mosaic_gpu_kernel_compiles_for_h100(
    tmp_path, monkeypatch, dtype, kv_dtype, window_cap, tokens_reqs, knobs
):
    """XLA:GPU compiles the kernel for an H100 without a GPU: Mosaic GPU's passes, then ptxas
    for sm_90a (its report, asked for through MOSAIC_GPU_DUMP_PTXAS, shows it ran)."""
    from xlm.platforms.target import compile_target

    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    (window, cap), (t, r) = window_cap, tokens_reqs
    mesh = jax.sharding.Mesh(np.array(compile_target("h100:1").devices[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    f = functools.partial(
        ragged_paged_attention_mosaic_gpu,
        sm_scale=0.1,
        sliding_window=window,
        soft_cap=cap,
        **knobs,
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(f).trace(*_abstract_args(dtype, kv_dtype, t=t, r=r, sharding=sharding))
        compiled = compiled.lower().compile()
    assert "mosaic_gpu" in compiled.as_text()
    reports = [p.read_text() for p in tmp_path.glob("*.ptxas")]
    assert reports and all("for 'sm_90a'" in report for report in reports), reports


# ---------------------------------------------------------------- real hardware


def _hopper() -> bool:
    if not _has("gpu"):
        return False
    capability = getattr(jax.devices("gpu")[0], "compute_capability", "0.0")
    return choose_gpu_kernel("99.0", capability) == "mosaic_gpu"


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype,window,cap,knobs", MOSAIC_GPU_CASES)
def test_mosaic_gpu_kernel_on_device(name, dtype, window, cap, knobs):
    if not _hopper():
        pytest.skip("no Hopper (sm_90+) GPU")
    # Float32 runs as three bfloat16 parts: summed in another order than the reference.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == jnp.float32 else None
    _check(_batch(name, dtype=dtype), dtype, window, cap, tol=tol, interpret=False, **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_mosaic_gpu_kernel_reads_an_fp8_cache_on_device(q_dtype):
    if not _hopper():
        pytest.skip("no Hopper (sm_90+) GPU")
    b = _batch("mixed_mid_page", dtype=q_dtype)
    b.kv_cache = np.asarray(write_kv(jnp.zeros(b.kv_cache.shape, jnp.float8_e4m3fn), *_kv(b)))
    tol = dict(rtol=1e-4, atol=1e-4) if q_dtype == jnp.float32 else None
    _check(b, q_dtype, window=7, tol=tol, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mosaic_gpu_kernel_pipelines_long_contexts_on_device(dtype):
    if not _hopper():
        pytest.skip("no Hopper (sm_90+) GPU")
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == jnp.float32 else None
    _check(_long_batch(dtype), dtype, 100, 20.0, tol=tol, interpret=False, **LONG_KNOBS)
