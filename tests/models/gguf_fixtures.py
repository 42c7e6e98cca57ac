"""Tiny synthetic GGUF files written from random Hugging Face-layout weights."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from xlm.models.loader.gguf import _BLOCK_TENSORS, _GLOBAL_TENSORS

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 32, 2, 4, 2, 64, 96
HEAD_DIM = HIDDEN // HEADS


def permute_for_llama_cpp(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute() of Q/K rows."""
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def random_hf_state_dict(arch: str, seed: int = 0, tied: bool = False) -> dict[str, np.ndarray]:
    """Random weights with the HF names and shapes of a tiny `arch` model."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.1
    sd = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": 1 + r(HIDDEN)}
    if not tied:
        sd["lm_head.weight"] = r(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": 1 + r(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + r(HIDDEN),
            p + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": r(FFN, HIDDEN),
            p + "mlp.up_proj.weight": r(FFN, HIDDEN),
            p + "mlp.down_proj.weight": r(HIDDEN, FFN),
        }
        if arch == "qwen2":
            for proj, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                sd[p + f"self_attn.{proj}_proj.bias"] = r(n * HEAD_DIM)
        if arch == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = 1 + r(HEAD_DIM)
            sd[p + "self_attn.k_norm.weight"] = 1 + r(HEAD_DIM)
    return sd


def _gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    for gguf, hf in _GLOBAL_TENSORS.items():
        if base == hf:
            return f"{gguf}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    gguf = {hf: g for g, hf in _BLOCK_TENSORS.items()}[rest]
    return f"blk.{layer}.{gguf}.{suffix}"


def write_gguf(
    path: str,
    arch: str,
    state_dict: dict[str, np.ndarray],
    extra_tensors: dict[str, np.ndarray] | None = None,
    metadata: dict[str, object] | None = None,
    quant_types: dict[str, GGMLQuantizationType] | None = None,
) -> str:
    """Write `state_dict` (HF names and layout) as an F32 GGUF the way llama.cpp would;
    `quant_types`: HF name -> the block type that tensor is stored in instead."""
    writer = GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", LAYERS)
    writer.add_uint32(f"{arch}.context_length", 256)
    writer.add_uint32(f"{arch}.embedding_length", HIDDEN)
    writer.add_uint32(f"{arch}.feed_forward_length", FFN)
    writer.add_uint32(f"{arch}.attention.head_count", HEADS)
    writer.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32(f"{arch}.vocab_size", VOCAB)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    for hf_name, weights in state_dict.items():
        if arch == "llama" and ".q_proj." in hf_name:
            weights = permute_for_llama_cpp(weights, HEADS)
        elif arch == "llama" and ".k_proj." in hf_name:
            weights = permute_for_llama_cpp(weights, KV_HEADS)
        qtype = (quant_types or {}).get(hf_name)
        if qtype is not None:
            blocks = quantize(np.ascontiguousarray(weights), qtype)
            writer.add_tensor(_gguf_name(hf_name), blocks, raw_dtype=qtype)
            continue
        writer.add_tensor(_gguf_name(hf_name), np.ascontiguousarray(weights))
    for name, weights in (extra_tensors or {}).items():
        writer.add_tensor(name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
