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
        (TpuPlatform, "forward_tpu", (2, NB, HKV, BS, D)),  # the Mosaic kernel's own layout
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


def abstract_inputs(cache_shape, dtype=jnp.bfloat16):
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
        s((T, HQ, D), dtype),
        s((T, HKV, D), dtype),
        s((T, HKV, D), dtype),
        s(cache_shape, dtype),
        md,
    )


def test_cuda_path_lowers_for_cuda(on_platform):
    on_platform(CudaPlatform)
    op = make_op()
    args = abstract_inputs(op.kv_cache_shape(NB, BS))
    text = jax.jit(op.forward_cuda).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def test_tpu_path_lowers_for_tpu(on_platform):
    on_platform(TpuPlatform)
    op = make_op()
    args = abstract_inputs(op.kv_cache_shape(NB, BS))
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(op.forward_tpu).trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
