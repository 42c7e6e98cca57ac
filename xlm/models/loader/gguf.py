"""GGUF checkpoints: Hugging Face config, dequantized tensors under HF names, safetensors export."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tqdm.auto import tqdm

from xlm import envs
from xlm.logger import init_logger
from xlm.models.loader.gguf_quants import SUPPORTED, decode, dequantize_raw, unpermute_rotary
from xlm.models.loader.gguf_reader import GGUFFile
from xlm.models.loader.gguf_tokenizer import gguf_tokenizer
from xlm.models.loader.safetensors_format import encode_header
from xlm.quantization import QuantLayout

logger = init_logger(__name__)

# GGUF general.architecture -> (HF model_type, HF architecture). Mistral ships as "llama".
SUPPORTED_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gpt2": ("gpt2", "GPT2LMHeadModel"),
}
_MISTRAL = ("mistral", "MistralForCausalLM")
# llama.cpp's converter permutes Q/K rows for its rotary layout only for these architectures.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per-architecture block names where llama.cpp's differ from the Llama mapping above.
_ARCH_BLOCK_TENSORS: dict[str, dict[str, str]] = {
    "gemma2": {
        **_BLOCK_TENSORS,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {
        **_BLOCK_TENSORS,
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",  # phi3's ffn_up holds gate and up rows
    },
    "gpt2": {
        "attn_norm": "ln_1",
        "attn_qkv": "attn.c_attn",
        "attn_output": "attn.c_proj",
        "ffn_norm": "ln_2",
        "ffn_up": "mlp.c_fc",
        "ffn_down": "mlp.c_proj",
    },
}
_GPT2_GLOBAL_TENSORS = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
# llama.cpp writes Gemma's RMSNorm weights as (1 + w); HF checkpoints hold w.
_GEMMA_NORM_OFFSET = 1.0
# GPT-2's Conv1D weights are [in, out]; llama.cpp stores them transposed.
_GPT2_TRANSPOSED = (".attn_qkv.weight", ".attn_output.weight", ".ffn_up.weight", ".ffn_down.weight")
# Tensors llama.cpp derives from the config; their information lives in the HF config instead.
_SKIPPED_TENSORS = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_DTYPES = ("float32", "bfloat16", "float16")


@lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The parsed header of a GGUF file (cached per path and modification time)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return _open_cached(path, os.stat(path).st_mtime_ns)


def _hf_types(gguf_file: GGUFFile) -> tuple[str, str]:
    arch = gguf_file.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {gguf_file.path} is not supported; "
            f"supported GGUF architectures: {sorted(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    if arch == "llama":
        names = " ".join(str(gguf_file.get(k, "")) for k in ("general.name", "general.basename"))
        if "mistral" in names.lower():
            return _MISTRAL
    return SUPPORTED_GGUF_ARCHITECTURES[arch]


def _llama3_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    # The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight.
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _llama3_factor(
    theta: float, head_dim: int, last: float, low: float, high: float, original: int
) -> float:
    # Invert the llama3 formula at the lowest frequency, the one scaled the most.
    wavelen = 2 * math.pi * theta ** ((head_dim - 2) / head_dim)
    if wavelen <= original / high:
        return last
    if wavelen > original / low:
        return last
    smooth = (original / wavelen - low) / (high - low)
    return (1 - smooth) / (1 / last - smooth)


def _rope_parameters(gguf_file: GGUFFile, arch: str, theta: float, head_dim: int) -> dict:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = gguf_file.get(f"{arch}.rope.scaling.type")
    factor = gguf_file.get(f"{arch}.rope.scaling.factor")
    original = gguf_file.get(f"{arch}.rope.scaling.original_context_length")
    if scaling is None and gguf_file.get(f"{arch}.rope.scale_linear") is not None:
        scaling, factor = "linear", gguf_file.get(f"{arch}.rope.scale_linear")
    if scaling == "linear" and factor:
        params.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn" and factor:
        params.update(rope_type="yarn", factor=float(factor))
        if original:
            params["original_max_position_embeddings"] = int(original)
    elif scaling not in (None, "none", "linear"):
        raise ValueError(f"{gguf_file.path}: unsupported rope scaling type {scaling!r}")
    if "rope_freqs.weight" in gguf_file.tensors:
        # Llama 3.1+ GGUFs carry only the derived factors; recover HF's llama3 parameters by
        # matching them against the values Meta's released models use.
        stored = dequantize(gguf_file.raw("rope_freqs.weight"), GGMLQuantizationType.F32)
        stored = np.asarray(stored, dtype=np.float32).reshape(-1)
        low, high, original = 1.0, 4.0, 8192
        # stored in float32: round the recovered factor back to the config's value
        factor = round(_llama3_factor(theta, head_dim, float(stored[-1]), low, high, original), 4)
        expected = _llama3_rope_factors(theta, head_dim, factor, low, high, original)
        if expected.shape != stored.shape or not np.allclose(expected, stored, rtol=1e-5):
            raise ValueError(
                f"{gguf_file.path}: rope_freqs.weight does not match llama3 rope scaling "
                f"(factor={factor}, low_freq_factor={low}, high_freq_factor={high}, "
                f"original_max_position_embeddings={original}); cannot derive the rope config"
            )
        params.update(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
        )
    return params


def _read_f32(gguf_file: GGUFFile, name: str) -> list[float]:
    values = dequantize(gguf_file.raw(name), GGMLQuantizationType.F32)
    return [float(v) for v in np.asarray(values, dtype=np.float32).reshape(-1)]


def _gpt2_config_dict(gguf_file: GGUFFile) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return gguf_file.get(f"gpt2.{key}", default)

    tokens = gguf_file.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if tokens else None)
    vocab = vocab or gguf_file.tensors["token_embd.weight"].shape[0]
    return {
        "architectures": ["GPT2LMHeadModel"],
        "n_embd": int(get("embedding_length")),
        "n_layer": int(get("block_count")),
        "n_head": int(get("attention.head_count")),
        "n_inner": int(get("feed_forward_length")),
        "n_positions": int(get("context_length", 1024)),
        "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": True,
    }


def _arch_config(gguf_file: GGUFFile, arch: str, config: dict[str, Any]) -> None:
    """Gemma 2 and Phi-3 specifics on top of the Llama-shaped config."""

    def get(key: str, default: Any = None) -> Any:
        return gguf_file.get(f"{arch}.{key}", default)

    if arch == "gemma2":
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["tie_word_embeddings"] = True
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                config[key] = float(get(key))
        # Not in the metadata: llama.cpp scales by 1/sqrt(head_dim), except Gemma 2 27B
        # (46 layers), which uses hidden_size / num_heads.
        scalar = config["head_dim"]
        if config["num_hidden_layers"] == 46:
            scalar = config["hidden_size"] // config["num_attention_heads"]
        config["query_pre_attn_scalar"] = scalar
    if arch == "phi3":
        original = get("rope.scaling.original_context_length")
        if original is not None:
            config["original_max_position_embeddings"] = int(original)
        if "rope_factors_long.weight" in gguf_file.tensors:
            config["rope_parameters"] = {
                "rope_type": "longrope",
                "rope_theta": config["rope_parameters"]["rope_theta"],
                "long_factor": _read_f32(gguf_file, "rope_factors_long.weight"),
                "short_factor": _read_f32(gguf_file, "rope_factors_short.weight"),
                "original_max_position_embeddings": int(original),
            }
        if get("attention.sliding_window") is None:
            config["sliding_window"] = None


def _config_dict(gguf_file: GGUFFile) -> dict[str, Any]:
    model_type, architecture = _hf_types(gguf_file)
    arch = gguf_file.architecture
    if arch == "gpt2":
        return {**_gpt2_config_dict(gguf_file), **_token_ids(gguf_file)}

    def get(key: str, default: Any = None) -> Any:
        return gguf_file.get(f"{arch}.{key}", default)

    required = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
    missing = [f"{arch}.{key}" for key in required if get(key) is None]
    if missing:
        raise ValueError(f"{gguf_file.path}: GGUF metadata lacks {missing}")
    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or 0)
    head_dim = head_dim or hidden_size // num_heads
    tokens = gguf_file.get("tokenizer.ggml.tokens")
    vocab_size = get("vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        vocab_size = gguf_file.tensors["token_embd.weight"].shape[0]
    theta = float(get("rope.freq_base", 10000.0))
    tensors = gguf_file.tensors
    config: dict[str, Any] = {
        "architectures": [architecture],
        "hidden_size": hidden_size,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": _rope_parameters(gguf_file, arch, theta, head_dim),
    }
    if model_type in ("llama", "mistral"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if get("attention.sliding_window") is not None:
        config["sliding_window"] = int(get("attention.sliding_window"))
    elif model_type == "mistral":
        config["sliding_window"] = None
    _arch_config(gguf_file, arch, config)
    return {**config, **_token_ids(gguf_file)}


def _token_ids(gguf_file: GGUFFile) -> dict[str, int]:
    out = {}
    for name in ("bos", "eos", "pad", "unk"):
        key = "padding" if name == "pad" else "unknown" if name == "unk" else name
        token_id = gguf_file.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            out[f"{name}_token_id"] = int(token_id)
    return out


def load_gguf_config(path: str) -> Any:
    """The Hugging Face `PretrainedConfig` described by a GGUF file's metadata."""
    from transformers import AutoConfig

    gguf_file = open_gguf(path)
    config = _config_dict(gguf_file)
    model_type, _ = _hf_types(gguf_file)
    return AutoConfig.for_model(model_type, **config)


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _SKIPPED_TENSORS:
        return None
    global_tensors = _GPT2_GLOBAL_TENSORS if arch == "gpt2" else _GLOBAL_TENSORS
    block_tensors = _ARCH_BLOCK_TENSORS.get(arch, _BLOCK_TENSORS)
    prefix = "transformer.h" if arch == "gpt2" else "model.layers"
    base, _, suffix = gguf_name.rpartition(".")
    if base in global_tensors and suffix in ("weight", "bias"):
        return f"{global_tensors[base]}.{suffix}"
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match and match.group(2) in block_tensors:
        layer, part, suffix = match.groups()
        return f"{prefix}.{layer}.{block_tensors[part]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in xlm's mapping")


def _unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # Inverse of llama.cpp's convert_hf_to_gguf permute(): its rows interleave the two rotary
    # halves of each head; HF keeps them as [first half, second half].
    head_size = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, head_size, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def gguf_tensor_names(path: str) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, in file order (skipping derived tensors)."""
    gguf_file = open_gguf(path)
    _hf_types(gguf_file)
    arch = gguf_file.architecture
    names = {name: _hf_name(name, arch) for name in gguf_file.tensors}
    return {name: hf for name, hf in names.items() if hf is not None}


def _hf_shape(arch: str, gguf_name: str, shape: list[int]) -> list[int]:
    """The HF shape of a GGUF tensor (GPT-2's Conv1D weights are transposed back)."""
    if arch == "gpt2" and gguf_name.endswith(_GPT2_TRANSPOSED):
        return shape[::-1]
    return shape


def _kept_quantized(gguf_name: str, info: Any) -> bool:
    """Whether a tensor stays in its block quants under quantization="gguf": the 2-D
    projections of a supported type (embeddings and the LM head are dequantized)."""
    base = gguf_name.rpartition(".")[0]
    return (
        gguf_name.endswith(".weight")
        and len(info.shape) == 2
        and info.tensor_type in SUPPORTED
        and base not in _GLOBAL_TENSORS
        and base not in _GPT2_GLOBAL_TENSORS
    )


def gguf_quant_layout(path: str) -> QuantLayout:
    """One grouped layout for every projection the GGUF keeps quantized: the smallest group
    of their types, and a minimum if any type has one."""
    gguf_file = open_gguf(path)
    formats = [
        SUPPORTED[info.tensor_type]
        for name, info in gguf_file.tensors.items()
        if _kept_quantized(name, info)
    ]
    if not formats:
        raise ValueError(
            f"quantization='gguf': {path} has no projection in a supported block type "
            f"({', '.join(t.name for t in SUPPORTED)})"
        )
    return QuantLayout(min(f.group_size for f in formats), any(f.has_minimum for f in formats))


def iter_gguf_tensors(path: str, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield every tensor under its HF name, dequantized to float32 in HF layout, one at a
    time; `keep_quantized`: projections in a supported block type as their codes and
    scales instead (gguf_quants.QuantizedWeight, in xlm's kernel layout [in, out])."""
    gguf_file = open_gguf(path)
    config = _config_dict(gguf_file)
    permute = gguf_file.architecture in _PERMUTED_QK_ARCHITECTURES
    for gguf_name, hf_name in gguf_tensor_names(path).items():
        info = gguf_file.tensors[gguf_name]
        if keep_quantized and _kept_quantized(gguf_name, info):
            weight = decode(gguf_file.raw(gguf_name), info.tensor_type, info.shape)
            if permute and ".attn_q." in gguf_name:
                weight = unpermute_rotary(weight, config["num_attention_heads"])
            elif permute and ".attn_k." in gguf_name:
                weight = unpermute_rotary(weight, config["num_key_value_heads"])
            yield hf_name, weight
            continue
        if info.tensor_type in SUPPORTED and len(info.shape) == 2:
            weights = dequantize_raw(gguf_file.raw(gguf_name), info.tensor_type, info.shape)
        else:
            weights = dequantize(gguf_file.raw(gguf_name), info.tensor_type)
            weights = np.asarray(weights, dtype=np.float32).reshape(info.shape)
        if permute and ".attn_q." in gguf_name:
            weights = _unpermute_rotary(weights, config["num_attention_heads"])
        elif permute and ".attn_k." in gguf_name:
            weights = _unpermute_rotary(weights, config["num_key_value_heads"])
        elif gguf_file.architecture == "gemma2" and hf_name.endswith("norm.weight"):
            weights = weights - np.float32(_GEMMA_NORM_OFFSET)
        elif gguf_file.architecture == "gpt2" and gguf_name.endswith(_GPT2_TRANSPOSED):
            weights = np.ascontiguousarray(weights.T)
        elif not weights.flags.owndata:
            weights = weights.copy()  # F32 tensors come back as views of the read-only map
        yield hf_name, weights


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if key in config}


def _safetensors_dtype(dtype: str) -> Any:
    return {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]


def gguf_to_safetensors(path: str, out_dir: str, dtype: str = "float32") -> str:
    """Write a HF directory (config, model.safetensors, tokenizer) from a GGUF file; return it."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {_DTYPES}")
    gguf_file = open_gguf(path)
    config = load_gguf_config(path)
    config.dtype = dtype
    names = gguf_tensor_names(path)
    os.makedirs(out_dir, exist_ok=True)
    np_dtype = _safetensors_dtype(dtype)

    # Stream tensors into the file: the header is known from the tensor table, so only one
    # dequantized tensor is ever in memory.
    shapes = {
        hf_name: _hf_shape(
            gguf_file.architecture, gguf_name, list(gguf_file.tensors[gguf_name].shape)
        )
        for gguf_name, hf_name in names.items()
    }
    header_bytes = encode_header((name, np_dtype, shape) for name, shape in shapes.items())

    target = os.path.join(out_dir, "model.safetensors")
    progress = tqdm(
        total=len(names),
        desc=f"Converting {os.path.basename(path)}",
        unit="tensor",
        disable=envs.XLM_DISABLE_PROGRESS_BARS,
    )
    try:
        with open(target + ".tmp", "wb") as f, progress:
            f.write(header_bytes)
            for hf_name, weights in iter_gguf_tensors(path):
                data = np.ascontiguousarray(weights.astype(np_dtype, copy=False))
                assert list(data.shape) == shapes[hf_name], hf_name
                data.tofile(f)
                progress.update()
        os.replace(target + ".tmp", target)
    finally:
        if os.path.exists(target + ".tmp"):
            os.remove(target + ".tmp")

    config.save_pretrained(out_dir)
    generation = _generation_config(config.to_dict())
    if generation:
        from transformers import GenerationConfig

        GenerationConfig(**generation).save_pretrained(out_dir)
    if gguf_file.get("tokenizer.ggml.tokens") is not None:
        gguf_tokenizer(path).save_pretrained(out_dir)
    else:
        logger.warning("%s has no tokenizer in its metadata; wrote no tokenizer files", path)
    logger.info("Converted %s to %s (%d tensors, %s)", path, out_dir, len(names), dtype)
    return out_dir
