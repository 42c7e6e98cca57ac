"""PEFT directories -> the model's LoRA slot layout, and every way an adapter is refused."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.lora.adapters import write_adapter
from xlm.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError, LoRASpec, load_adapter

MAX_RANK = 8
PREFIX = "base_model.model.model.layers.0."


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def spec(llama) -> LoRASpec:
    from xlm.engine.arg_utils import EngineArgs
    from xlm.models.loader import get_model

    config = EngineArgs(
        model=llama, enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK, startup_programs="used"
    ).create_config()
    return LoRASpec.of(get_model(config), MAX_RANK)


@pytest.fixture(scope="module")
def good(llama, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("adapters") / "good")
    write_adapter(llama, path, "llama", seed=0, r=4, lora_alpha=12)
    return path


def copy(good: str, tmp_path, name: str = "bad") -> str:
    path = str(tmp_path / name)
    shutil.copytree(good, path)
    return path


def edit_config(path: str, **changes) -> None:
    config_path = os.path.join(path, CONFIG_FILE)
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


def edit_tensors(path: str, fn) -> None:
    weights = os.path.join(path, WEIGHTS_FILE)
    tensors = fn(dict(load_file(weights)))
    save_file(tensors, weights)


def test_layout_scaling_and_fused_parts(spec, good):
    tensors = load_file(os.path.join(good, WEIGHTS_FILE))
    weights = load_adapter(good, spec)
    assert weights.rank == 4
    scale = 12 / 4
    # One projection: A in the first 4 rank columns, B scaled in the first 4 rows.
    a, b = weights.weights["model.layers.0.self_attn.q_proj"]
    np.testing.assert_array_equal(a[:, :4], tensors[PREFIX + "self_attn.q_proj.lora_A.weight"].T)
    assert not a[:, 4:].any() and not b[4:].any()
    np.testing.assert_allclose(
        b[:4], tensors[PREFIX + "self_attn.q_proj.lora_B.weight"].T * scale, rtol=1e-6
    )
    # gate and up fused in xlm: each in its own rank block and its own columns.
    a, b = weights.weights["model.layers.0.mlp.gate_up_proj"]
    inter = b.shape[1] // 2
    for part, name in enumerate(("gate_proj", "up_proj")):
        rows = slice(part * MAX_RANK, part * MAX_RANK + 4)
        cols = slice(part * inter, (part + 1) * inter)
        np.testing.assert_array_equal(a[:, rows], tensors[PREFIX + f"mlp.{name}.lora_A.weight"].T)
        np.testing.assert_allclose(
            b[rows, cols], tensors[PREFIX + f"mlp.{name}.lora_B.weight"].T * scale, rtol=1e-6
        )
        other = slice((1 - part) * inter, (2 - part) * inter)
        assert not b[rows, other].any()
    assert len(weights.weights) == len(spec.targets)  # every projection adapted


def test_rslora_and_alpha_pattern_scales(spec, good, tmp_path):
    path = copy(good, tmp_path)
    edit_config(path, use_rslora=True, alpha_pattern={"o_proj": 2})
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    weights = load_adapter(path, spec)
    _, b = weights.weights["model.layers.0.self_attn.q_proj"]
    want = tensors[PREFIX + "self_attn.q_proj.lora_B.weight"].T * (12 / math.sqrt(4))
    np.testing.assert_allclose(b[:4], want, rtol=1e-6)
    _, b = weights.weights["model.layers.1.self_attn.o_proj"]
    want = tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"].T
    np.testing.assert_allclose(b[:4], want * (2 / math.sqrt(4)), rtol=1e-6)


def _drop_b(tensors):
    del tensors[PREFIX + "self_attn.q_proj.lora_B.weight"]
    return tensors


def _unknown_module(tensors):
    tensors[PREFIX + "mlp.nonexistent.lora_A.weight"] = np.zeros((4, 64), np.float32)
    tensors[PREFIX + "mlp.nonexistent.lora_B.weight"] = np.zeros((64, 4), np.float32)
    return tensors


def _embedding(tensors):
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = np.zeros((4, 256), np.float32)
    return tensors


def _wrong_in_features(tensors):
    name = PREFIX + "self_attn.q_proj.lora_A.weight"
    tensors[name] = np.zeros((4, 63), np.float32)
    return tensors


def _rank_mismatch(tensors):
    name = PREFIX + "self_attn.q_proj.lora_B.weight"
    tensors[name] = np.zeros((64, 3), np.float32)
    return tensors


def _rank_too_high(tensors):
    for which, shape in (("A", (16, 64)), ("B", (64, 16))):
        tensors[PREFIX + f"self_attn.q_proj.lora_{which}.weight"] = np.ones(shape, np.float32)
    return tensors


@pytest.mark.parametrize(
    "edit, reason",
    [
        (_drop_b, "has no lora_B"),
        (_unknown_module, "'model.layers.0.mlp.nonexistent' is not a projection"),
        (_embedding, "is not a lora_A / lora_B weight"),
        (_wrong_in_features, "the model's projection needs [r, 64]"),
        (_rank_mismatch, "expected [r, in] and [out, r]"),
        (_rank_too_high, "has rank 16, above max_lora_rank=8"),
    ],
)
def test_bad_tensors_are_refused(spec, good, tmp_path, edit, reason):
    path = copy(good, tmp_path)
    edit_tensors(path, edit)
    with pytest.raises(LoRAAdapterError) as e:
        load_adapter(path, spec)
    assert reason in str(e.value)


@pytest.mark.parametrize(
    "changes, reason",
    [
        (dict(use_dora=True), "DoRA adapters are not supported"),
        (dict(bias="all"), "trained biases are not supported"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="PREFIX_TUNING"), "is not LORA"),
        (dict(lora_alpha="big"), "lora_alpha='big' is not a number"),
    ],
)
def test_unsupported_configs_are_refused(spec, good, tmp_path, changes, reason):
    path = copy(good, tmp_path)
    edit_config(path, **changes)
    with pytest.raises(LoRAAdapterError, match=reason):
        load_adapter(path, spec)


def test_missing_and_malformed_files_are_refused(spec, good, tmp_path):
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        load_adapter(str(tmp_path / "nowhere"), spec)
    path = copy(good, tmp_path, "no_config")
    os.remove(os.path.join(path, CONFIG_FILE))
    with pytest.raises(LoRAAdapterError, match="has no adapter_config.json"):
        load_adapter(path, spec)
    path = copy(good, tmp_path, "bad_json")
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        f.write("{not json")
    with pytest.raises(LoRAAdapterError, match="is not JSON"):
        load_adapter(path, spec)
    path = copy(good, tmp_path, "bin_only")
    os.rename(os.path.join(path, WEIGHTS_FILE), os.path.join(path, "adapter_model.bin"))
    with pytest.raises(LoRAAdapterError, match="convert it to safetensors"):
        load_adapter(path, spec)
    path = copy(good, tmp_path, "truncated")
    weights = os.path.join(path, WEIGHTS_FILE)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(LoRAAdapterError, match="is malformed"):
        load_adapter(path, spec)
    path = copy(good, tmp_path, "garbage")
    with open(os.path.join(path, WEIGHTS_FILE), "wb") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(LoRAAdapterError, match="is malformed"):
        load_adapter(path, spec)
