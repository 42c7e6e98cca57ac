"""Placing checkpoint tensors: whole tensors and packed pieces land on the device as the
checkpoint holds them, a shape that does not fit names the tensor and the parameter."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlm.models.loader.placement import WeightPlacer, checkpoint_shape, min_path, scale_path


def _placer(**shapes):
    variables = {path: nnx.Param(jnp.zeros(shape, jnp.float32)) for path, shape in shapes.items()}
    return WeightPlacer(variables, jnp.float32, mesh=None)


def test_a_whole_tensor_is_placed_as_given():
    placer = _placer(w=(2, 3))
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    placer.place("model.w", "w", None, value)
    np.testing.assert_array_equal(np.asarray(placer.placed["w"]), value)


def test_pieces_of_a_packed_parameter_are_placed_once_all_arrived():
    placer = _placer(qkv=(2, 4))
    top, bottom = np.ones((1, 4), np.float32), np.full((1, 4), 2.0, np.float32)
    placer.place("q", "qkv", np.s_[0:1], top)
    assert "qkv" not in placer.placed  # half of it: not yet on the device
    placer.place("k", "qkv", np.s_[1:2], bottom)
    np.testing.assert_array_equal(np.asarray(placer.placed["qkv"]), np.vstack([top, bottom]))


def test_a_shape_mismatch_names_the_tensor_and_the_parameter():
    placer = _placer(w=(2, 3))
    with pytest.raises(ValueError, match=r"'model.w'.*\(3, 2\).*'w' shape \(2, 3\)$"):
        placer.place("model.w", "w", None, np.zeros((2, 3), np.float32).T, transposed=False)
    kernel = r"checkpoint shape \(2, 3\).*\(2, 3\) \(\[in, out\] kernel"
    with pytest.raises(ValueError, match=kernel):
        placer.place("model.w", "w", None, np.zeros((3, 2), np.float32), transposed=True)
    with pytest.raises(KeyError, match="unknown parameter 'v'"):
        placer.place("model.v", "v", None, np.zeros(1, np.float32))


def test_paths_beside_a_kernel_and_the_checkpoint_shape():
    assert scale_path("layers.0.q_proj.kernel") == "layers.0.q_proj.weight_scale"
    assert min_path("layers.0.q_proj.kernel") == "layers.0.q_proj.weight_min"
    assert checkpoint_shape(nnx.Param(jnp.zeros((4, 8)))) == (4, 8)
