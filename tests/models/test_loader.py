"""Weight loading: formats, dtypes, tied embeddings, and clear errors."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from tests.models.logits_check import run_schedule
from xlm.config import LoRAConfig, ModelConfig, XlmConfig
from xlm.models.loader import get_model, resolve_dtype, resolve_load_format, resolve_weight_dtype
from xlm.models.loader.safetensors_format import iter_safetensors_tensors


def load(model_dir: str, **kwargs) -> nnx.Module:
    return get_model(XlmConfig(ModelConfig(model=model_dir, **kwargs)))


def read_all(model_dir: str) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in iter_safetensors_tensors(model_dir)}


def copy_with_tensors(src: str, dst: str, tensors: dict[str, np.ndarray]) -> str:
    """A copy of checkpoint `src` whose weights are replaced by `tensors`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in flat}


def test_missing_model_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        load(missing)
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        load(missing + ".gguf")


def test_auto_load_format_picks_gguf_for_gguf_paths():
    assert resolve_load_format("/m/model.gguf", "auto") == "gguf"
    assert resolve_load_format("/m/dir", "auto") == "safetensors"
    assert resolve_load_format("/m/model.gguf", "dummy") == "dummy"


def test_a_dummy_load_of_a_gguf_reads_its_config_from_the_gguf(smollm2_gguf):
    """`xlm plan smollm2-135m` (a built-in name that resolves to a .gguf) loads "dummy":
    the config still comes from the GGUF's metadata, not from a directory."""
    from xlm.engine.arg_utils import EngineArgs
    from xlm.models.loader import load_hf_config

    gguf = load_hf_config(smollm2_gguf, "gguf")
    dummy = load_hf_config(smollm2_gguf, "dummy")
    assert dummy.to_dict() == gguf.to_dict() and dummy.num_attention_heads == 9
    config = EngineArgs(model="smollm2-135m", load_format="dummy").create_config()
    assert config.model_config.hf_config.to_dict() == gguf.to_dict()


def test_missing_config_and_weights(tmp_path, tiny_checkpoint):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(str(empty))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_checkpoint("llama"), no_weights, ignore=shutil.ignore_patterns("*.safe*"))
    with pytest.raises(FileNotFoundError, match=r"no_weights.*model\.safetensors"):
        load(str(no_weights))


def edit_config(model_dir: str, **changes) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del config[k]
    with open(path, "w") as f:
        json.dump(config, f)


def test_config_without_architectures(tmp_path, tiny_checkpoint):
    model_dir = str(tmp_path / "m")
    shutil.copytree(tiny_checkpoint("llama"), model_dir)
    edit_config(model_dir, architectures=None)
    with pytest.raises(ValueError, match="no 'architectures'.*LlamaForCausalLM"):
        load(model_dir)


def test_unsupported_architecture_lists_supported(tmp_path, tiny_checkpoint):
    model_dir = str(tmp_path / "m")
    shutil.copytree(tiny_checkpoint("llama"), model_dir)
    edit_config(model_dir, architectures=["FancyForCausalLM"])
    with pytest.raises(ValueError, match="FancyForCausalLM.*Qwen3MoeForCausalLM"):
        load(model_dir)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path, tiny_checkpoint):
    tensors = read_all(tiny_checkpoint("llama"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    model_dir = copy_with_tensors(tiny_checkpoint("llama"), str(tmp_path / "m"), tensors)
    with pytest.raises(
        ValueError, match=r"layers\.1\.self_attn\.k_proj\.weight.*\(48, 64\).*\(64, 32\)"
    ):
        load(model_dir)


def test_unused_and_missing_tensors_are_listed(tmp_path, tiny_checkpoint):
    tensors = read_all(tiny_checkpoint("llama"))
    tensors["model.layers.0.extra.weight"] = np.zeros((3,), np.float32)
    del tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((8,), np.float32)
    model_dir = copy_with_tensors(tiny_checkpoint("llama"), str(tmp_path / "m"), tensors)
    with pytest.raises(ValueError) as e:
        load(model_dir)
    assert "never loaded: ['model.norm.weight']" in str(e.value)
    assert "never used: ['model.layers.0.extra.weight']" in str(e.value)


def test_sharded_index(tmp_path, tiny_checkpoint):
    src = tiny_checkpoint("qwen2")
    tensors = read_all(src)
    model_dir = tmp_path / "sharded"
    shutil.copytree(src, model_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(model_dir / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got, want = params(load(str(model_dir))), params(load(src))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_bf16_checkpoint_and_dtypes(tmp_path, tiny_checkpoint):
    import torch
    from safetensors.torch import save_file as save_torch

    src = tiny_checkpoint("llama")
    tensors = read_all(src)
    model_dir = tmp_path / "bf16"
    shutil.copytree(src, model_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_torch(
        {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()},
        str(model_dir / "model.safetensors"),
    )
    edit_config(str(model_dir), dtype="bfloat16")
    model = load(str(model_dir))  # auto on CPU -> float32
    emb = params(model)["model.embed_tokens.weight"]
    assert emb.dtype == np.float32
    rounded = torch.from_numpy(tensors["model.embed_tokens.weight"]).to(torch.bfloat16)
    np.testing.assert_array_equal(emb, rounded.float().numpy())
    model = load(str(model_dir), dtype="bfloat16")
    # CPU: half projections and embeddings, float32 norms (activations float32).
    assert params(model)["model.layers.0.self_attn.qkv_proj.kernel"].dtype == jnp.bfloat16
    assert params(model)["model.embed_tokens.weight"].dtype == jnp.bfloat16
    assert params(model)["model.norm.weight"].dtype == jnp.float32
    assert resolve_dtype("float16", None) == jnp.float32
    assert resolve_weight_dtype("float16") == jnp.float16
    assert resolve_weight_dtype("float32") is None


def test_tied_embeddings(tiny_checkpoint):
    model = load(tiny_checkpoint("llama3"))
    assert model.lm_head is None
    p = params(model)
    assert not any(k.startswith("lm_head") for k in p)
    hidden = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(model.compute_logits(hidden)),
        hidden @ p["model.embed_tokens.weight"].T,
        rtol=1e-5,
        atol=1e-5,
    )


def test_dummy_format(tmp_path, tiny_checkpoint):
    model_dir = str(tmp_path / "config_only")
    shutil.copytree(
        tiny_checkpoint("qwen3_moe"), model_dir, ignore=shutil.ignore_patterns("*.safe*")
    )
    a = load(model_dir, load_format="dummy", seed=1)
    b = load(model_dir, load_format="dummy", seed=1)
    c = load(model_dir, load_format="dummy", seed=2)
    pa, pb, pc = params(a), params(b), params(c)
    key = "model.layers.1.mlp.gate_up_proj"
    np.testing.assert_array_equal(pa[key], pb[key])
    assert not np.array_equal(pa[key], pc[key])
    # Each matrix its own values, at the scale of its fan-in (q, k and v merged: one).
    qkv, o = (np.asarray(pa[f"model.layers.0.self_attn.{n}_proj.kernel"]) for n in ("qkv", "o"))
    if a.model.layers[0].self_attn.qkv_proj.out_major:  # stored [out, in]: back to [in, out]
        qkv, o = qkv.T, o.T
    assert qkv.shape[0] == o.shape[0] and not np.array_equal(qkv[:, : o.shape[1]], o)
    embed = np.asarray(pa["model.embed_tokens.weight"])
    for name, value, fan_in in (("qkv", qkv, qkv.shape[0]), ("embed", embed, embed.shape[-1])):
        assert abs(value.std() * fan_in**0.5 - 1) < 0.1, name
    rng = np.random.default_rng(0)
    ids = {r: rng.integers(0, 256, 20).tolist() for r in "ABC"}
    logits = np.concatenate(list(run_schedule(a, ids, seed=0).values()))
    assert np.isfinite(logits).all() and logits.std() > 1e-3


def test_sharding_metadata_and_mesh_placement(tiny_checkpoint):
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    model = get_model(XlmConfig(ModelConfig(model=tiny_checkpoint("llama"))), mesh=mesh)
    attn = model.model.layers[0].self_attn
    # Column-parallel q|k|v names its output dimension, row-parallel o its input: dims 1
    # and 0 of [in, out], 0 and 1 of [out, in] (Linear.out_major: the CPU float kernel's
    # layout where the model axis is one device, as here).
    q_spec = ("model", None) if attn.qkv_proj.out_major else (None, "model")
    assert attn.qkv_proj.kernel.get_metadata()["out_sharding"] == q_spec
    assert attn.o_proj.kernel.get_metadata()["out_sharding"] == q_spec[::-1]
    sharding = attn.qkv_proj.kernel[...].sharding
    assert isinstance(sharding, jax.sharding.NamedSharding)
    assert sharding.spec == jax.sharding.PartitionSpec(*q_spec)


def test_q_k_v_are_merged_only_without_lora(tiny_checkpoint):
    """At one device a checkpoint's separate q, k and v load into one qkv_proj (the
    family tests check its values against transformers); with LoRA on they stay three,
    as the adapters name them. (Tensor parallelism keeps them apart too: tests/
    distributed read q_proj.)"""
    path = tiny_checkpoint("llama")
    plain = get_model(XlmConfig(ModelConfig(model=path, load_format="dummy")))
    lora = LoRAConfig(max_loras=1, max_lora_rank=4)
    adapted = get_model(XlmConfig(ModelConfig(model=path, load_format="dummy"), lora_config=lora))
    merged, apart = plain.model.layers[0].self_attn, adapted.model.layers[0].self_attn
    assert merged.fused_qkv and not hasattr(merged, "q_proj")
    heads = merged.num_heads + 2 * merged.num_kv_heads
    assert merged.num_kv_heads < merged.num_heads  # grouped-query: k and v narrower than q
    assert merged.qkv_proj.out_features == heads * merged.head_dim
    assert not apart.fused_qkv and not hasattr(apart, "qkv_proj")
    assert apart.q_proj.out_features == apart.num_heads * apart.head_dim


def test_moe_fused_expert_tensors_load_like_per_expert(tmp_path, tiny_checkpoint):
    src = tiny_checkpoint("qwen3_moe")
    tensors = read_all(src)
    prefix = "model.layers.1.mlp.experts"
    num_experts = 8

    def pop(e, proj):
        return tensors.pop(f"{prefix}.{e}.{proj}.weight")

    gate_up, down = [], []
    for e in range(num_experts):
        gate_up.append(np.concatenate([pop(e, "gate_proj"), pop(e, "up_proj")]))
        down.append(pop(e, "down_proj"))
    tensors[f"{prefix}.gate_up_proj"] = np.stack(gate_up)
    tensors[f"{prefix}.down_proj"] = np.stack(down)
    fused = params(load(copy_with_tensors(src, str(tmp_path / "fused"), tensors)))
    want = params(load(src))
    for k in want:
        np.testing.assert_array_equal(fused[k], want[k])


def test_auto_dtype_follows_platform_and_checkpoint(monkeypatch):
    import xlm.platforms

    cfg = type("Cfg", (), {"dtype": "float32"})()
    assert resolve_dtype("auto", cfg) == jnp.float32  # CPU: no fast bf16
    platform = xlm.platforms.current_platform
    monkeypatch.setattr(platform, "supports_fast_bf16", True)
    assert resolve_dtype("auto", cfg) == jnp.bfloat16  # float32 checkpoints serve in bf16
    assert resolve_dtype("auto", type("Cfg", (), {"dtype": "float16"})()) == jnp.float16
    assert resolve_dtype("auto", type("Cfg", (), {"torch_dtype": "bfloat16"})()) == jnp.bfloat16
    assert resolve_dtype("float32", cfg) == jnp.float32
    assert resolve_dtype("float16", cfg) == jnp.float16  # fast bf16: half all through
    assert resolve_weight_dtype("bfloat16") is None
