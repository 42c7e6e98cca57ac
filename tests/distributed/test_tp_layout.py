"""Tensor-parallel layout rules on one device: errors that name the numbers, KV-head
replication and the per-shard gate/up interleave the loader applies."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import LlamaConfig

from xlm.config import ModelConfig, ParallelConfig, XlmConfig, set_current_xlm_config
from xlm.distributed.tensor_parallel import kv_head_replicas, logical_shape, to_physical
from xlm.models.llama import LlamaForCausalLM
from xlm.models.loader import build_abstract_model


def build(tp: int, **overrides):
    hf = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=overrides.pop("intermediate_size", 96),
        num_hidden_layers=1,
        num_attention_heads=overrides.pop("heads", 12),
        num_key_value_heads=overrides.pop("kv_heads", 4),
    )
    config = XlmConfig(ModelConfig(model="m"), parallel_config=ParallelConfig(tp))
    with set_current_xlm_config(config):
        return build_abstract_model(LlamaForCausalLM, hf, np.float32)


@pytest.mark.parametrize(
    ("tp", "overrides", "message"),
    [
        (5, {}, r"num_attention_heads=12 cannot be split over tensor_parallel_size=5"),
        (6, {}, r"num_key_value_heads=4 cannot be split over tensor_parallel_size=6"),
        (4, {"intermediate_size": 90}, r"intermediate_size=90 .* tensor_parallel_size=4"),
    ],
)
def test_unsplittable_widths_name_the_numbers(tp, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(tp, **overrides)


def test_fewer_kv_heads_than_devices_are_replicated():
    assert kv_head_replicas(4, 2) == 1 and kv_head_replicas(2, 8) == 4
    model = build(12)  # 4 KV heads over 12 devices: each stored 3 times
    attn = model.model.layers[0].self_attn
    assert attn.num_kv_heads == 12 and model.kv_cache_spec() == (1, 12, 4)
    kernel = attn.k_proj.kernel
    assert kernel.shape == (48, 12 * 4)
    assert logical_shape(kernel.shape, kernel.get_metadata()) == (48, 4 * 4)


def test_physical_layout_repeats_heads_and_interleaves_gate_up_per_shard():
    heads = np.arange(2 * 3).reshape(1, 6).astype(np.float32)  # 2 heads of dim 3
    got = to_physical(heads, {"head_replicas": (2, 3)})
    np.testing.assert_array_equal(got, [[0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]])
    gate, up = np.arange(4), 10 + np.arange(4)  # 4 columns each, 2 shards
    got = to_physical(np.concatenate([gate, up])[None], {"fused_shards": (2, 2)})
    np.testing.assert_array_equal(got, [[0, 1, 10, 11, 2, 3, 12, 13]])
