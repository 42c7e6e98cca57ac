"""GGUF loading: config, tensors and conversion agree with transformers' own GGUF support."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tests.models.gguf_fixtures import HEAD_DIM, random_hf_state_dict, write_gguf
from xlm.models.loader.gguf import (
    _llama3_rope_factors,
    gguf_to_safetensors,
    iter_gguf_tensors,
    load_gguf_config,
)

REPO_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646],
    [1, 4093, 198, 19556, 905, 28, 2, 198, 1, 520, 9531, 198],
    [19556],
]


def _logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _assert_logits_close(actual: np.ndarray, expected: np.ndarray) -> None:
    # The weights are bit-identical (test_tensors_equal_transformers_dequantization), but for a
    # one-token prompt torch's GEMV sums in an order that depends on the weights' memory
    # alignment (mmapped safetensors vs numpy copies): up to 6e-5 on logits of magnitude ~15.
    # Prompts of several tokens come out bit-identical.
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)


# ---- the real SmolLM2 GGUF ----


@pytest.mark.slow
def test_tensors_equal_transformers_dequantization(smollm2_gguf, smollm2_transformers_gguf_model):
    reference = smollm2_transformers_gguf_model.state_dict()
    seen = set()
    for name, weights in iter_gguf_tensors(smollm2_gguf):
        assert weights.dtype == np.float32
        expected = reference[name].numpy()
        assert weights.shape == expected.shape, name
        np.testing.assert_array_equal(weights, expected, err_msg=name)
        seen.add(name)
    assert "lm_head.weight" not in seen  # tied to the embedding in this checkpoint
    assert seen == set(reference) - {"lm_head.weight"}
    assert len(seen) == 272


def test_config_matches_transformers(smollm2_gguf):
    from transformers import AutoConfig

    config = load_gguf_config(smollm2_gguf)
    directory, filename = os.path.split(smollm2_gguf)
    reference = AutoConfig.from_pretrained(directory, gguf_file=filename)
    assert type(config) is type(reference)
    assert config.architectures == ["LlamaForCausalLM"]
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "rope_parameters",
        "attention_bias",
        "mlp_bias",
    ):
        assert getattr(config, key) == getattr(reference, key), key
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}


@pytest.mark.slow
def test_converted_directory_logits_equal_transformers_gguf(
    smollm2_hf_dir, smollm2_transformers_gguf_model
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = set(os.listdir(smollm2_hf_dir))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    with open(os.path.join(smollm2_hf_dir, "generation_config.json")) as f:
        generation = json.load(f)
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir).eval()
    assert model.dtype == torch.float32
    assert model.config.architectures == ["LlamaForCausalLM"]
    for ids in PROMPTS:
        _assert_logits_close(_logits(model, ids), _logits(smollm2_transformers_gguf_model, ids))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>"


@pytest.mark.slow
def test_cli_convert_builtin_name(tmp_path, smollm2_transformers_gguf_model):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, XLM_DISABLE_PROGRESS_BARS="1")
    result = subprocess.run(
        [sys.executable, "-m", "xlm.entrypoints.cli", "convert", "smollm2-135m", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Converting" not in result.stderr  # progress bar disabled by the env var
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    _assert_logits_close(
        _logits(model, PROMPTS[0]), _logits(smollm2_transformers_gguf_model, PROMPTS[0])
    )


# ---- synthetic GGUFs: the llama.cpp layout round-trips to HF ----


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_gguf_round_trips(tmp_path, arch):
    sd = random_hf_state_dict(arch, tied=arch == "qwen3")
    path = write_gguf(str(tmp_path / f"{arch}.gguf"), arch, sd)
    got = dict(iter_gguf_tensors(path))
    assert set(got) == set(sd)
    for name, weights in sd.items():
        np.testing.assert_array_equal(got[name], weights, err_msg=name)
    config = load_gguf_config(path)
    expected_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    assert config.architectures == [expected_arch.get(arch, "Qwen3ForCausalLM")]
    assert config.tie_word_embeddings is (arch == "qwen3")
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (2, HEAD_DIM, 96)


def test_synthetic_llama_converts_and_matches_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    sd = random_hf_state_dict("llama", seed=1)
    path = write_gguf(str(tmp_path / "tiny.gguf"), "llama", sd)
    out = gguf_to_safetensors(path, str(tmp_path / "hf"), dtype="float32")
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    config = LlamaConfig(**{k: v for k, v in load_gguf_config(path).to_dict().items()})
    original = LlamaForCausalLM(config).eval()
    original.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    ids = [3, 17, 5, 60, 2, 9]
    np.testing.assert_allclose(_logits(converted, ids), _logits(original, ids), atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_convert_dtype(tmp_path, dtype):
    sd = random_hf_state_dict("qwen2")
    path = write_gguf(str(tmp_path / "tiny.gguf"), "qwen2", sd)
    out = gguf_to_safetensors(path, str(tmp_path / "hf"), dtype=dtype)
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        weights = f.get_tensor("model.layers.0.self_attn.q_proj.bias")
    assert weights.dtype == getattr(torch, dtype)
    expected = torch.from_numpy(sd["model.layers.0.self_attn.q_proj.bias"]).to(weights.dtype)
    assert torch.equal(weights, expected)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == dtype
    with pytest.raises(ValueError, match="dtype='int8'"):
        gguf_to_safetensors(path, str(tmp_path / "bad"), dtype="int8")


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    factors = _llama3_rope_factors(10000.0, HEAD_DIM, 8.0, 1.0, 4.0, 8192)
    path = write_gguf(
        str(tmp_path / "l3.gguf"),
        "llama",
        random_hf_state_dict("llama"),
        extra_tensors={"rope_freqs.weight": factors},
    )
    config = load_gguf_config(path)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == 8.0
    assert "rope_freqs.weight" not in dict(iter_gguf_tensors(path))


def test_mistral_detected_from_name(tmp_path):
    path = write_gguf(
        str(tmp_path / "m.gguf"),
        "llama",
        random_hf_state_dict("llama"),
        metadata={"general.name": "Mistral 7B Instruct v0.3"},
    )
    config = load_gguf_config(path)
    assert config.model_type == "mistral"
    assert config.architectures == ["MistralForCausalLM"]


# ---- errors ----


def test_unsupported_architecture(tmp_path):
    path = write_gguf(str(tmp_path / "bert.gguf"), "bert", random_hf_state_dict("qwen2"))
    with pytest.raises(ValueError, match="'bert'.*not supported.*llama"):
        load_gguf_config(path)
    with pytest.raises(ValueError, match="'bert'"):
        next(iter_gguf_tensors(path))


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_config(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all, just bytes")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_config(str(bad))


def test_dequantized_weights_are_cached_once(tmp_path, monkeypatch):
    from xlm.metrics import startup
    from xlm.models.loader import _dequantized_gguf_dir, _tensor_source

    monkeypatch.setenv("XLM_CACHE_ROOT", str(tmp_path / "cache"))
    sd = random_hf_state_dict("llama")
    path = write_gguf(str(tmp_path / "tiny.gguf"), "llama", sd)
    direct = dict(iter_gguf_tensors(path))
    monkeypatch.setattr(startup, "_deferred", [])
    # Cold: the GGUF itself, the cache written only once the deferred work runs.
    tensors, total = _tensor_source(path, "gguf")
    assert total is None and not (tmp_path / "cache").exists()
    assert {name: np.array(t) for name, t in tensors}.keys() == direct.keys()
    startup.run_deferred().join(60)
    tensors, total = _tensor_source(path, "gguf")
    via_cache = {name: np.array(t) for name, t in tensors}
    assert total == len(direct) and via_cache.keys() == direct.keys()
    for name, value in direct.items():
        np.testing.assert_array_equal(via_cache[name], value, err_msg=name)
    cache_dir = _dequantized_gguf_dir(path)
    assert cache_dir.startswith(str(tmp_path / "cache"))
    stamp = os.stat(os.path.join(cache_dir, "model.safetensors")).st_mtime_ns
    assert _dequantized_gguf_dir(path) == cache_dir  # reused, not rewritten
    assert os.stat(os.path.join(cache_dir, "model.safetensors")).st_mtime_ns == stamp


def test_dequantized_weights_cache_is_versioned_private_and_rebuilt(tmp_path, monkeypatch):
    import stat

    import xlm
    from xlm.models.loader import _dequantized_gguf_dir

    monkeypatch.setenv("XLM_CACHE_ROOT", str(tmp_path / "cache"))
    path = write_gguf(str(tmp_path / "tiny.gguf"), "llama", random_hf_state_dict("llama"))
    cache_dir = _dequantized_gguf_dir(path)
    root = os.path.dirname(cache_dir)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert os.listdir(root) == [os.path.basename(cache_dir)]  # no temporary directories
    weights = os.path.join(cache_dir, "model.safetensors")
    good = open(weights, "rb").read()
    # A truncated copy (a crash mid-write, a full disk) is rebuilt, not loaded or fatal.
    with open(weights, "r+b") as f:
        f.truncate(len(good) // 2)
    assert _dequantized_gguf_dir(path) == cache_dir
    assert open(weights, "rb").read() == good
    # A corrupt header of the right size is rebuilt too.
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 16)
    assert _dequantized_gguf_dir(path) == cache_dir
    assert open(weights, "rb").read() == good
    # Another xlm version keys another copy.
    monkeypatch.setattr(xlm, "__version__", xlm.__version__ + ".post1")
    assert _dequantized_gguf_dir(path) != cache_dir


def test_failed_dequantization_leaves_no_temporary_directory(tmp_path, monkeypatch):
    from xlm.models.loader import _dequantized_gguf_dir, gguf

    monkeypatch.setenv("XLM_CACHE_ROOT", str(tmp_path / "cache"))
    path = write_gguf(str(tmp_path / "tiny.gguf"), "llama", random_hf_state_dict("llama"))

    def full_disk(src, out_dir, dtype="float32"):
        with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf, "gguf_to_safetensors", full_disk)
    assert _dequantized_gguf_dir(path) is None
    assert os.listdir(tmp_path / "cache" / "gguf_weights") == []
