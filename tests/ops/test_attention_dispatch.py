"""The attention op picks its kernel per platform, owns the cache layout, and its CUDA and
TPU paths lower for those backends from this CPU machine."""

import jax
import jax.numpy as jnp
import pytest

from xlm.config import CompilationConfig, ModelConfig, XlmConfig, set_current_xlm_config
from xlm.ops.paged_attention import AttentionMetadata, PagedAttention
from xlm.platforms.cpu import CpuPlatform
from xlm.platforms.cuda import CudaPlatform
from xlm.platforms.tpu import TpuPlatform

HQ, HKV, D, BS, NB, T, R, B = 8, 2, 128, 16, 32, 24, 4, 8


def make_op(**kwargs):
    return PagedAttention(HQ, HKV, D, D**-0.5, sliding_window=64, logits_soft_cap=30.0, **kwargs)


@pytest.mark.parametrize(
    ("platform_cls", "forward", "shape"),
    [
        (CpuPlatform, "forward_cpu", (2, NB, BS, HKV, D)),
        (CudaPlatform, "forward_cuda", (2, NB, BS, HKV, D)),
        # The Mosaic kernel's pages with heads and positions merged (one row per pair).
        (TpuPlatform, "forward_tpu", (2, NB, HKV * BS, D)),
    ],
)
def test_dispatch_and_layout_follow_the_platform(on_platform, platform_cls, forward, shape):
    on_platform(platform_cls)
    op = make_op()
    assert op._forward_name == forward
    assert op.kv_cache_shape(NB, BS) == shape


def test_disabled_kernel_falls_back_to_native_layout(on_platform):
    on_platform(TpuPlatform)
    config = XlmConfig(
        ModelConfig(model="m"),
        compilation_config=CompilationConfig(custom_ops=["-paged_attention"]),
    )
    with set_current_xlm_config(config):
        op = make_op()
    assert op._forward_name == "forward_native"
    assert op.kv_cache_shape(NB, BS) == (2, NB, BS, HKV, D)


def abstract_inputs(cache_shape, dtype=jnp.bfloat16, hq=HQ, hkv=HKV):
    s = jax.ShapeDtypeStruct
    md = AttentionMetadata(
        positions=s((T,), jnp.int32),
        slot_mapping=s((T,), jnp.int32),
        query_start_loc=s((R + 1,), jnp.int32),
        seq_lens=s((R,), jnp.int32),
        block_tables=s((R, B), jnp.int32),
        num_seqs=s((1,), jnp.int32),
    )
    return (
        s((T, hq, D), dtype),
        s((T, hkv, D), dtype),
        s((T, hkv, D), dtype),
        s(cache_shape, dtype),
        md,
    )


def test_cuda_path_lowers_for_cuda(on_platform):
    on_platform(CudaPlatform)
    op = make_op()
    args = abstract_inputs(op.kv_cache_shape(NB, BS))
    text = jax.jit(op.forward_cuda).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


@pytest.mark.parametrize("kv_heads_per_chip", [1, 2])
def test_tpu_path_compiles_for_a_tp4_slice(on_platform, kv_heads_per_chip):
    """The op's TPU path (write and kernel over its stored layout, per head shard) compiled
    by the TPU compiler for a v5e:2x2 slice at TP=4, with no copy of the cache around the
    write: with one KV head per chip the former 5-D layout cost two whole-cache copies per
    layer (its temp bytes were the cache's)."""
    pytest.importorskip("libtpu")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from xlm.platforms.target import compile_target

    on_platform(TpuPlatform)
    hkv = 4 * kv_heads_per_chip
    op = PagedAttention(4 * hkv, hkv, D, D**-0.5)
    num_blocks = 50000  # the compiler picks the cache layout by its size: a large cache
    mesh = jax.sharding.Mesh(compile_target("v5e:2x2").devices, ("model",))
    heads = NamedSharding(mesh, P(None, "model", None))
    specs = (heads, heads, heads, NamedSharding(mesh, P(*op.kv_cache_sharding())))
    q, k, v, cache, md = abstract_inputs(
        op.kv_cache_shape(num_blocks, BS), hq=op.num_heads, hkv=hkv
    )
    q, k, v, cache = (
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
        for a, sh in zip((q, k, v, cache), specs)
    )
    md = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), md
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(op.forward_tpu, donate_argnums=(3,)).lower(q, k, v, cache, md).compile()
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    cache_bytes_per_chip = 2 * num_blocks * kv_heads_per_chip * BS * D * 2
    assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes_per_chip / 16


def test_tpu_path_equals_native_over_two_steps(on_platform, monkeypatch):
    """The TPU path (its stored layout, write and the Mosaic kernel in interpret mode) gives
    the native path's outputs for a prefill step and then a decode step reading it back."""
    import functools

    import numpy as np

    import pallas_kernels.ragged_paged_attention as rpa
    from tests.paged_batch import BlockAllocator, StepRequest, build_metadata

    monkeypatch.setattr(
        rpa,
        "ragged_paged_attention_tpu",
        functools.partial(rpa.ragged_paged_attention_tpu, interpret=True),
    )
    rng = np.random.default_rng(0)
    blocks = BlockAllocator(NB)
    tables = [blocks.allocate(3), blocks.allocate(2)]
    steps = [[StepRequest(tables[0], 0, 37), StepRequest(tables[1], 0, 20)]]
    steps.append([StepRequest(tables[0], 37, 1), StepRequest(tables[1], 20, 1)])
    outputs = {}
    for platform_cls in (CpuPlatform, TpuPlatform):
        on_platform(platform_cls)
        op = make_op()
        cache = jnp.zeros(op.kv_cache_shape(NB, BS), jnp.float32)
        rng = np.random.default_rng(0)
        outs = []
        for reqs in steps:
            md = build_metadata(reqs, BS, max_blocks=B)
            t = int(md.query_start_loc[-1])
            q, k, v = (
                jnp.asarray(rng.standard_normal((t, h, D)), jnp.float32) for h in (HQ, HKV, HKV)
            )
            out, cache = op(q, k, v, cache, md)
            outs.append(np.asarray(out))
        outputs[platform_cls] = outs
    for native, tpu in zip(outputs[CpuPlatform], outputs[TpuPlatform]):
        np.testing.assert_allclose(tpu, native, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.int8])
def test_cpu_kernel_path_equals_native_over_two_steps(on_platform, cache_dtype):
    """On CPU the op writes K/V and runs the native kernel (xlm.ops.cpu_kernels): a prefill
    step and a decode step reading it back equal the jnp path, float32 or int8 cache."""
    import numpy as np

    from tests.paged_batch import BlockAllocator, StepRequest, build_metadata
    from xlm.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no C++ compiler")
    on_platform(CpuPlatform)
    op = make_op()
    assert op._forward_name == "forward_cpu"
    blocks = BlockAllocator(NB)
    tables = [blocks.allocate(3), blocks.allocate(2)]
    steps = [[StepRequest(tables[0], 0, 37), StepRequest(tables[1], 0, 20)]]
    steps.append([StepRequest(tables[0], 37, 1), StepRequest(tables[1], 20, 1)])
    outputs = {}
    for path in ("kernel", "native"):
        forward = op if path == "kernel" else op.forward_native
        cache = jnp.zeros(op.kv_cache_shape(NB, BS, cache_dtype), cache_dtype)
        rng = np.random.default_rng(0)
        outs = []
        for reqs in steps:
            md = build_metadata(reqs, BS, max_blocks=B)
            t = int(md.query_start_loc[-1])
            q, k, v = (
                jnp.asarray(rng.standard_normal((t, h, D)), jnp.float32) for h in (HQ, HKV, HKV)
            )
            out, cache = jax.jit(forward)(q, k, v, cache, md)
            outs.append(np.asarray(out))
        outputs[path] = outs
    for kernel, native in zip(outputs["kernel"], outputs["native"]):
        np.testing.assert_allclose(kernel, native, rtol=2e-5, atol=2e-5)
