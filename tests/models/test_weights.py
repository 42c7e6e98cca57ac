"""Where a Hugging Face tensor lands in an xlm model: fused gate/up columns, transposed
Linear kernels, parameters taken as they are, recomputed buffers skipped."""

from __future__ import annotations

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
