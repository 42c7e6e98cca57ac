"""Where a Hugging Face tensor lands in an xlm model: fused gate/up columns, q/k/v merged
into unequal columns, transposed Linear kernels, parameters taken as they are, recomputed
buffers skipped; and when a model merges q, k and v."""

from __future__ import annotations

import pytest

from xlm.models.weights import WeightTarget, column_part, default_weight_targets

SHAPES = {
    "model.layers.0.mlp.gate_up_proj.kernel": (8, 12),
    "model.layers.0.self_attn.q_proj.kernel": (8, 8),
    "model.layers.0.self_attn.q_proj.bias": (8,),
    "model.norm.weight": (8,),
}


def test_gate_and_up_fill_the_two_halves_of_the_fused_kernel():
    (gate,) = default_weight_targets("model.layers.0.mlp.gate_proj.weight", SHAPES)
    (up,) = default_weight_targets("model.layers.0.mlp.up_proj.weight", SHAPES)
    assert gate.param == up.param == "model.layers.0.mlp.gate_up_proj.kernel"
    assert gate.index == (slice(None), slice(0, 6)) and up.index == (slice(None), slice(6, 12))
    assert gate.transpose and up.transpose


# Grouped-query attention: 4 query heads and 1 KV head of 2 dims, hidden 8.
QKV_SHAPES = {
    "model.layers.0.self_attn.qkv_proj.kernel": (8, 12),
    "model.layers.0.self_attn.qkv_proj.weight_scale": (2, 12),
    "model.layers.0.self_attn.qkv_proj.bias": (12,),
    "model.layers.0.self_attn.o_proj.kernel": (8, 8),
}


def test_q_k_v_fill_unequal_columns_of_the_merged_kernel():
    """q takes o_proj's input width (num_heads * head_dim), k and v split the rest; the
    kernel, its scales and its bias alike."""
    layer = "model.layers.0.self_attn"
    for leaf, target_leaf, lead in (
        ("weight", "kernel", 1),
        ("weight_scale", "weight_scale", 1),
        ("bias", "bias", 0),
    ):
        targets = [default_weight_targets(f"{layer}.{x}_proj.{leaf}", QKV_SHAPES)[0] for x in "qkv"]
        assert {t.param for t in targets} == {f"{layer}.qkv_proj.{target_leaf}"}
        cols = [t.index[-1] for t in targets]
        assert cols == [slice(0, 8), slice(8, 10), slice(10, 12)], leaf
        assert all(len(t.index) == lead + 1 for t in targets)
        assert all(t.transpose == (leaf == "weight") for t in targets)
    bad = dict(QKV_SHAPES, **{f"{layer}.qkv_proj.kernel": (8, 11)})
    with pytest.raises(ValueError, match="qkv_proj.kernel: 11 columns"):
        default_weight_targets(f"{layer}.k_proj.weight", bad)


def test_linear_weights_are_transposed_into_kernels_and_others_kept():
    assert default_weight_targets("model.layers.0.self_attn.q_proj.weight", SHAPES) == [
        WeightTarget("model.layers.0.self_attn.q_proj.kernel", transpose=True)
    ]
    assert default_weight_targets("model.layers.0.self_attn.q_proj.bias", SHAPES) == [
        WeightTarget("model.layers.0.self_attn.q_proj.bias")
    ]
    assert default_weight_targets("model.norm.weight", SHAPES) == [
        WeightTarget("model.norm.weight")
    ]


def test_buffers_are_skipped_and_unknown_names_unmapped():
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    assert default_weight_targets(name, SHAPES) == [WeightTarget.skip()]
    assert WeightTarget.skip().param == ""
    assert default_weight_targets("model.layers.9.mlp.gate_proj.weight", SHAPES) == []


def test_column_part_splits_the_last_axis():
    assert column_part((2, 3, 12), 2, 3) == (slice(None), slice(None), slice(8, 12))
