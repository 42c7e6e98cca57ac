"""The model building blocks against numpy: Linear, the embeddings and LM head, the gated
MLP and its per-shard gate|up layout, and the rope parameters a transformers config gives
(the attention layer inside whole models: tests/models/test_llama.py and the families)."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlm.distributed.mesh import TP_AXIS
from xlm.models import layers
from xlm.models.layers import (
    GatedMLP,
    Linear,
    ParallelLMHead,
    PositionEmbedding,
    VocabEmbedding,
    gated_activation,
    rope_parameters,
    rotary_from_config,
)

RNG = np.random.default_rng(0)


def _set(variable: nnx.Param, value: np.ndarray) -> None:
    assert variable.shape == value.shape
    variable.set_value(jnp.asarray(value))


def _set_kernel(linear: Linear, value: np.ndarray) -> None:
    """A Linear's kernel from its [in, out] value, in the layout it stores (out_major:
    [out, in], the CPU float kernel's)."""
    _set(linear.kernel, value.T if linear.out_major else value)


def _random(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_x_times_kernel_plus_bias(bias):
    layer = Linear(6, 5, bias=bias, rngs=nnx.Rngs(0))
    # On CPU the float kernel is stored [out, in] (FloatMatmul.prefers_out_major).
    assert layer.out_major == layer.matmul.prefers_out_major(jnp.float32)
    assert layer.kernel.shape == ((5, 6) if layer.out_major else (6, 5))
    w, b, x = _random(6, 5), _random(5), _random(3, 6)
    _set_kernel(layer, w)
    if bias:
        _set(layer.bias, b)
    else:
        assert layer.bias is None
    want = x @ w + (b if bias else 0)
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)
    assert layer.lora is None and layer.quant is None  # neither LoRA nor quantization is on


def test_parallel_linears_name_the_dimension_they_split(monkeypatch):
    # Under tensor parallelism (two devices here) kernels are [in, out]: out_major is one
    # device's whole kernel.
    monkeypatch.setattr(layers, "tp_size", lambda: 2)
    column = Linear(4, 8, bias=True, parallel="column", rngs=nnx.Rngs(0))
    row = Linear(8, 4, bias=True, parallel="row", rngs=nnx.Rngs(0))
    assert not column.out_major and not row.out_major
    assert column.kernel.get_metadata()["out_sharding"] == (None, TP_AXIS)
    assert column.bias.get_metadata()["out_sharding"] == (TP_AXIS,)
    assert row.kernel.get_metadata()["out_sharding"] == (TP_AXIS, None)
    assert row.bias.get_metadata()["out_sharding"] == (None,)  # added after the reduction
    assert column.kernel.get_metadata()["eager_sharding"] is False


def test_embeddings_and_lm_head_against_numpy():
    table, positions, hidden = _random(11, 4), _random(7, 4), _random(3, 4)
    ids = np.array([0, 10, 3, 3])
    embed = VocabEmbedding(11, 4, rngs=nnx.Rngs(0))
    _set(embed.weight, table)
    np.testing.assert_array_equal(np.asarray(embed(jnp.asarray(ids))), table[ids])
    logits = np.asarray(embed.attend(jnp.asarray(hidden)))
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, hidden @ table.T, rtol=1e-5, atol=1e-5)
    head = ParallelLMHead(11, 4, rngs=nnx.Rngs(0))
    _set(head.weight, table)
    np.testing.assert_allclose(np.asarray(head(jnp.asarray(hidden))), hidden @ table.T, atol=1e-5)
    assert head.weight.get_metadata()["out_sharding"] == (TP_AXIS, None)  # split by vocab
    pos = PositionEmbedding(7, 4, rngs=nnx.Rngs(0))
    _set(pos.weight, positions)
    np.testing.assert_array_equal(np.asarray(pos(jnp.asarray([6, 0, 2]))), positions[[6, 0, 2]])


def test_gated_mlp_is_down_of_silu_gate_times_up():
    mlp = GatedMLP(4, 6, hidden_act="silu", rngs=nnx.Rngs(0))
    gate, up, down, x = _random(4, 6), _random(4, 6), _random(6, 4), _random(5, 4)
    _set_kernel(mlp.gate_up_proj, np.concatenate([gate, up], axis=1))
    _set_kernel(mlp.down_proj, down)
    want = (_silu(x @ gate) * (x @ up)) @ down
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x))), want, rtol=1e-4, atol=1e-5)


def test_gated_activation_reads_each_shards_gate_then_up_columns():
    """Under tensor parallelism the fused columns are [gate_0 | up_0 | gate_1 | up_1]."""
    gate, up = _random(3, 2, 5), _random(3, 2, 5)  # [tokens, shards, I / shards]
    fused = np.concatenate([gate, up], axis=2).reshape(3, 20)
    silu_and_mul = (
        lambda v: jnp.asarray(  # noqa: E731
            _silu(np.asarray(v)[..., : v.shape[-1] // 2]) * np.asarray(v)[..., v.shape[-1] // 2 :]
        )
    )
    got = np.asarray(gated_activation(silu_and_mul, jnp.asarray(fused), shards=2))
    np.testing.assert_allclose(got, (_silu(gate) * up).reshape(3, 10), rtol=1e-6)


@pytest.mark.parametrize(
    "config, theta, scaling",
    [
        (SimpleNamespace(rope_theta=5e5), 5e5, None),  # transformers 4.x, default rope
        (SimpleNamespace(), 10000.0, None),
        (
            SimpleNamespace(rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
            1e4,
            {"rope_type": "linear", "factor": 2.0},
        ),
        (  # transformers 5.x: one dict
            SimpleNamespace(rope_parameters={"rope_theta": 2e4, "rope_type": "default"}),
            2e4,
            None,
        ),
        (
            SimpleNamespace(
                rope_parameters={"rope_theta": 2e4, "rope_type": "yarn", "factor": 4.0}
            ),
            2e4,
            {"rope_type": "yarn", "factor": 4.0},
        ),
    ],
)
def test_rope_parameters_of_both_transformers_config_shapes(config, theta, scaling):
    assert rope_parameters(config) == (theta, scaling)


def test_rope_parameters_per_layer_type_and_the_rotary_they_build():
    nested = SimpleNamespace(
        rope_parameters={
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
            "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
        },
        max_position_embeddings=64,
        original_max_position_embeddings=32,
    )
    assert rope_parameters(nested, "sliding_attention") == (1e4, None)
    assert rope_parameters(nested, "full_attention") == (
        1e6,
        {"rope_type": "linear", "factor": 8.0},
    )
    rotary = rotary_from_config(nested, 16, "full_attention")
    assert rotary.base == 1e6 and rotary.rope_type == "linear"
    assert dict(rotary.scaling)["original_max_position_embeddings"] == 32
    partial = SimpleNamespace(rope_theta=1e4, partial_rotary_factor=0.5, max_position_embeddings=8)
    assert rotary_from_config(partial, 16).rotary_dim == 8
