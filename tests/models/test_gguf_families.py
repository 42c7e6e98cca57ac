"""GGUF files of Gemma 2, Phi-3 and GPT-2, written in llama.cpp's layout from the tiny
transformers checkpoints: xlm reads back the same config and tensors, transformers' own
GGUF loader agrees on the tensors (so the layout written here is the one it reads), and
xlm's logits from the GGUF equal the original checkpoint's in transformers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from gguf import GGUFWriter
from safetensors.numpy import load_file

from tests.conftest import VOCAB_SIZE, write_tiny_checkpoint
from tests.models.logits_check import PROMPT_LENS, SCHEDULE, hf_logits, run_schedule
from xlm.config import ModelConfig, XlmConfig
from xlm.models.loader import get_model
from xlm.models.loader.gguf import (
    _ARCH_BLOCK_TENSORS,
    _GLOBAL_TENSORS,
    _GPT2_GLOBAL_TENSORS,
    _GPT2_TRANSPOSED,
    iter_gguf_tensors,
    load_gguf_config,
)

ARCHS = {"gemma2": "gemma2", "phi3": "phi3", "gpt2": "gpt2"}  # test name -> GGUF arch
# GGUF has no query_pre_attn_scalar (llama.cpp uses head_dim): a Gemma 2 it can describe.
# transformers' GPT-2 GGUF reader takes n_positions, the MLP width and the vocabulary
# from its defaults / the token list: keep GPT-2's own 1024 and 4 * n_embd.
GGUF_CHANGES = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gpt2": dict(max_position_embeddings=1024, n_inner=None),
}


def _gguf_name(arch: str, hf_name: str) -> str | None:
    base, suffix = hf_name.rsplit(".", 1)
    globals_ = _GPT2_GLOBAL_TENSORS if arch == "gpt2" else _GLOBAL_TENSORS
    for gguf, hf in globals_.items():
        if base == hf:
            return f"{gguf}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    gguf = {hf: g for g, hf in _ARCH_BLOCK_TENSORS[arch].items()}[rest]
    return f"blk.{layer}.{gguf}.{suffix}"


def write_llama_cpp_gguf(
    arch: str, model_dir: str, path: str, token_list: bool = False
) -> dict[str, np.ndarray]:
    """What llama.cpp's convert_hf_to_gguf writes for this checkpoint (float32); with
    `token_list`, a bare token list (transformers sizes GPT-2's vocabulary by it)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    w = GGUFWriter(path, arch)
    u32 = lambda k, v: w.add_uint32(f"{arch}.{k}", int(v))  # noqa: E731
    f32 = lambda k, v: w.add_float32(f"{arch}.{k}", float(v))  # noqa: E731
    if arch == "gpt2":
        u32("block_count", cfg["n_layer"])
        u32("context_length", cfg["n_positions"])
        u32("embedding_length", cfg["n_embd"])
        u32("feed_forward_length", cfg["n_inner"] or 4 * cfg["n_embd"])
        u32("attention.head_count", cfg["n_head"])
        f32("attention.layer_norm_epsilon", cfg["layer_norm_epsilon"])
    else:
        u32("block_count", cfg["num_hidden_layers"])
        u32("context_length", cfg["max_position_embeddings"])
        u32("embedding_length", cfg["hidden_size"])
        u32("feed_forward_length", cfg["intermediate_size"])
        u32("attention.head_count", cfg["num_attention_heads"])
        u32("attention.head_count_kv", cfg["num_key_value_heads"])
        f32("attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
        f32("rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    if arch == "gemma2":
        u32("attention.key_length", cfg["head_dim"])
        u32("attention.value_length", cfg["head_dim"])
        u32("attention.sliding_window", cfg["sliding_window"])
        f32("attn_logit_softcapping", cfg["attn_logit_softcapping"])
        f32("final_logit_softcapping", cfg["final_logit_softcapping"])
    if arch == "phi3":
        rope = cfg["rope_parameters"]
        u32("rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    if token_list:
        w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    w.add_uint32("tokenizer.ggml.padding_token_id", cfg["pad_token_id"])
    for name, weights in sd.items():
        gguf = _gguf_name(arch, name)
        if arch == "gemma2" and name.endswith("norm.weight"):
            weights = weights + 1.0
        if arch == "gpt2" and gguf.endswith(_GPT2_TRANSPOSED):
            weights = weights.T
        w.add_tensor(gguf, np.ascontiguousarray(weights, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


@pytest.fixture(scope="module")
def gguf_case(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp("gguf")
            if arch in GGUF_CHANGES:
                model_dir = write_tiny_checkpoint(arch, str(root / "hf"), **GGUF_CHANGES[arch])
            else:
                model_dir = tiny_checkpoint(arch)
            path = str(root / f"{arch}.gguf")
            made[arch] = model_dir, path, write_llama_cpp_gguf(ARCHS[arch], model_dir, path)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_config_and_tensors_round_trip(arch, gguf_case):
    from transformers import AutoConfig

    model_dir, path, sd = gguf_case(arch)
    got = dict(iter_gguf_tensors(path))
    assert set(got) == set(sd)
    for name, weights in sd.items():
        np.testing.assert_allclose(got[name], weights, rtol=0, atol=1e-6, err_msg=name)
    config, ref = load_gguf_config(path), AutoConfig.from_pretrained(model_dir)
    keys = ["architectures", "hidden_size", "num_hidden_layers", "num_attention_heads"]
    keys += {
        "gemma2": ["head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types"]
        + ["attn_logit_softcapping", "final_logit_softcapping", "hidden_activation"],
        "phi3": ["num_key_value_heads", "original_max_position_embeddings", "rope_parameters"],
        "gpt2": ["n_positions", "layer_norm_epsilon", "activation_function"],
    }[arch]
    for key in keys:
        want = getattr(ref, key)
        want = pytest.approx(want, rel=1e-6) if isinstance(want, float) else want
        assert getattr(config, key) == want, key


@pytest.mark.parametrize("arch", list(ARCHS))
def test_transformers_reads_the_same_tensors(arch, gguf_case):
    import torch
    from transformers import AutoModelForCausalLM

    model_dir, path, sd = gguf_case(arch)
    if arch == "gpt2":
        path = path.replace(".gguf", "-tokens.gguf")
        write_llama_cpp_gguf(ARCHS[arch], model_dir, path, token_list=True)
    directory, filename = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    theirs = {k: v.numpy() for k, v in model.state_dict().items()}
    for name, weights in sd.items():
        if name == "lm_head.weight" and name not in theirs:
            continue
        np.testing.assert_allclose(theirs[name], weights, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_from_gguf_match_transformers(arch, gguf_case):
    model_dir, path, _ = gguf_case(arch)
    model = get_model(XlmConfig(ModelConfig(model=path, dtype="float32")))
    rng = np.random.default_rng(0)
    fed = {r: sum(plan.get(r, 0) for plan in SCHEDULE) for r in PROMPT_LENS}
    ids = {r: rng.integers(0, VOCAB_SIZE, n).tolist() for r, n in fed.items()}
    got = run_schedule(model, ids, seed=2)
    for r, t in ids.items():
        ref = hf_logits(model_dir, t)
        np.testing.assert_allclose(got[r], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
