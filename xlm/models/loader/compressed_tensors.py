"""compressed-tensors checkpoints (llm-compressor's format, vLLM's main quantized one).

A Hugging Face directory whose ``config.json`` has ``quantization_config.quant_method ==
"compressed-tensors"`` stores each quantized ``nn.Linear`` as its 8-bit codes (``weight``
[out, in], int8 or float8 e4m3; or ``weight_packed``, four int8 codes per int32 word, with
``weight_shape``) and ``weight_scale`` ([out, 1] per channel, [1] or a scalar per tensor).
The codes map onto xlm's schemes as they are stored (``checkpoint_scheme``):

- int8 weights, no activation quantization -> ``int8``;
- int8 weights, dynamic symmetric per-token int8 activations -> ``w8a8``;
- float8 e4m3 weights -> ``fp8``, activations in float whatever the checkpoint says
  (xlm's fp8 scheme is weight-only; static input scales are read and not used).

``compressed_tensors_weights`` turns each layer's tensors into one ``QuantizedWeight``
(codes [in, out], scales [1, out]; a per-tensor scale repeated over the columns, exactly),
which the loader places as it is: never dequantized, never requantized. Layers the
checkpoint left in float (``ignore``, ``targets``) stay float in xlm too
(``float_projections``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from xlm.models.loader.gguf_quants import QuantizedWeight

QUANT_METHOD = "compressed-tensors"
# Formats that store 8-bit codes xlm reads as they are.
_FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")
_WEIGHT_STRATEGIES = ("channel", "tensor")
# Tensors of a quantized layer besides its codes and weight scales that xlm does not use:
# fp8 static activation scales (xlm runs fp8 activations in float).
_UNUSED = ("input_scale",)
# Per-layer tensor names (their suffix after the layer's module name).
_CODES = ("weight", "weight_packed")
_PARTS = (*_CODES, "weight_scale", "weight_shape")


def quantization_config(hf_config: Any) -> dict | None:
    """The checkpoint's compressed-tensors ``quantization_config`` (None: not one).

    Raises ValueError for a checkpoint quantized by another method: xlm reads
    compressed-tensors (and GGUF files), not AWQ, GPTQ, bitsandbytes, ...
    """
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(
            f"The checkpoint is quantized with quant_method={method!r}, which xlm does not "
            f"read: supported are {QUANT_METHOD!r} int8/fp8 checkpoints (and GGUF files); "
            "load a float checkpoint with --quantization int8|w8a8|fp8 instead"
        )
    return qc


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"compressed-tensors checkpoint: {what} is not supported (xlm reads symmetric 8-bit "
        "int or fp8 weights per channel or per tensor, with int8 per-token dynamic or no "
        "activation quantization; fp8 activations run in float)"
    )


def _group_scheme(name: str, group: dict, default_format: str | None) -> str:
    """The xlm scheme of one config group; ValueError naming what is not supported."""
    fmt = group.get("format") or default_format
    if fmt not in _FORMATS:
        raise _unsupported(f"format {fmt!r} ({name})")
    weights = group.get("weights")
    if not weights:
        raise _unsupported(f"a group without weight quantization ({name})")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if bits != 8 or kind not in ("int", "float"):
        raise _unsupported(f"{bits}-bit {kind} weights ({name})")
    if not weights.get("symmetric", True):
        raise _unsupported(f"asymmetric weights (zero points) ({name})")
    strategy = weights.get("strategy")
    if strategy not in _WEIGHT_STRATEGIES:
        raise _unsupported(f"weight strategy {strategy!r} ({name})")
    if weights.get("dynamic"):
        raise _unsupported(f"dynamic weight scales ({name})")
    if fmt == "pack-quantized" and kind != "int":
        raise _unsupported(f"pack-quantized {kind} weights ({name})")
    if group.get("output_activations"):
        raise _unsupported(f"output activation quantization ({name})")
    acts = group.get("input_activations")
    if kind == "float":
        return "fp8"  # activations, if quantized, run in float (weight-only fp8)
    if not acts:
        return "int8"
    if (
        acts.get("type", "int") != "int"
        or acts.get("num_bits") != 8
        or not acts.get("dynamic")
        or acts.get("strategy") != "token"
        or not acts.get("symmetric", True)
    ):
        raise _unsupported(
            f"int8 weights with input activations {_describe(acts)} ({name}; xlm's w8a8 "
            "quantizes activations dynamically per token, symmetric)"
        )
    return "w8a8"


def _describe(args: dict) -> str:
    keys = ("num_bits", "type", "strategy", "symmetric", "dynamic")
    return "{" + ", ".join(f"{k}={args.get(k)!r}" for k in keys) + "}"


def checkpoint_scheme(qc: dict) -> str:
    """The xlm scheme (``int8``, ``w8a8``, ``fp8``) a compressed-tensors config stores;
    ValueError naming the first thing xlm does not support."""
    for key in ("kv_cache_scheme", "transform_config"):
        if qc.get(key):
            hint = " (use --kv-cache-dtype fp8 without scales)" if key == "kv_cache_scheme" else ""
            raise _unsupported(f"{key}{hint}")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise _unsupported(f"sparsity format {sparsity['format']!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _unsupported("a quantization_config without config_groups")
    schemes = {name: _group_scheme(name, group, qc.get("format")) for name, group in groups.items()}
    names = sorted(set(schemes.values()))
    if len(names) > 1:
        raise _unsupported(f"groups in different schemes ({names}: xlm runs one per model)")
    return names[0]


def resolve_quantization(requested: str | None, hf_config: Any) -> str | None:
    """The scheme to run: the checkpoint's own for a compressed-tensors checkpoint (a
    different ``requested`` one is a ValueError naming both), else ``requested``."""
    qc = quantization_config(hf_config)
    if qc is None:
        return requested
    scheme = checkpoint_scheme(qc)
    if requested is not None and requested != scheme:
        raise ValueError(
            f"quantization={requested!r} conflicts with the checkpoint: it is a "
            f"compressed-tensors checkpoint stored as {scheme!r}; pass "
            f"quantization={scheme!r} or leave it unset"
        )
    return scheme


def is_quantized_dtype(dtype: str) -> bool:
    """Whether a safetensors dtype name is a compressed layer's codes (1 byte, or packed)."""
    return dtype in ("I8", "F8_E4M3", "I32")


def _codes(prefix: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """A layer's int8 / fp8 codes [out, in] (unpacked from int32 words if packed)."""
    if "weight" in parts:
        return parts["weight"]
    packed, shape = parts["weight_packed"], parts.get("weight_shape")
    if shape is None:
        raise ValueError(f"compressed-tensors checkpoint: {prefix}.weight_shape is missing")
    out, inputs = (int(n) for n in np.asarray(shape).reshape(-1))
    # 8-bit codes lie in the words' bytes in order, offset by 128 (compressed-tensors'
    # pack_to_int32 along the input dimension).
    unsigned = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8)
    if unsigned.shape[0] != out or unsigned.shape[1] < inputs:
        raise ValueError(
            f"compressed-tensors checkpoint: {prefix}.weight_packed {packed.shape} does not "
            f"hold {prefix}.weight_shape {[out, inputs]} in 8-bit codes"
        )
    return (unsigned[:, :inputs].astype(np.int16) - 128).astype(np.int8)


def _quantized_weight(prefix: str, parts: dict[str, np.ndarray]) -> QuantizedWeight:
    codes = _codes(prefix, parts)
    if codes.ndim != 2 or codes.dtype.itemsize != 1:
        raise ValueError(
            f"compressed-tensors checkpoint: {prefix} codes {codes.dtype}{list(codes.shape)} "
            "are not a 2-D 8-bit weight"
        )
    out = codes.shape[0]
    scale = np.asarray(parts["weight_scale"], np.float32)
    if scale.size == 1:  # per tensor: the same scale for every column, exactly
        scale = np.full((1, out), scale.reshape(()), np.float32)
    elif scale.size == out:
        scale = scale.reshape(1, out)
    else:
        raise _unsupported(
            f"{prefix}.weight_scale of shape {list(scale.shape)} for {out} output channels "
            "(group or block scales)"
        )
    return QuantizedWeight(
        codes=codes.T,
        scale=scale,
        minimum=None,
        group_size=codes.shape[1],
        qtype=f"compressed-tensors {codes.dtype}",
    )


def compressed_tensors_weights(
    tensors: Iterator[tuple[str, np.ndarray]],
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized layer's codes and scales as one
    ``(prefix.weight, QuantizedWeight)`` (yielded once both have been read, in any order);
    fp8 input scales dropped, every other tensor as it is."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_zero_point":
            raise _unsupported(f"asymmetric weights ({name})")
        if leaf in _UNUSED:
            continue
        if leaf == "weight" and array.dtype.itemsize != 1:
            yield name, array  # a float tensor: norms, embeddings, layers left in float
            continue
        if leaf not in _PARTS:
            yield name, array
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = array
        packed = "weight_packed" in parts
        if "weight_scale" in parts and ("weight" in parts or (packed and "weight_shape" in parts)):
            yield f"{prefix}.weight", _quantized_weight(prefix, pending.pop(prefix))
    if pending:
        incomplete = {p: sorted(parts) for p, parts in pending.items()}
        raise ValueError(
            "compressed-tensors checkpoint: layers without both codes and weight_scale: "
            f"{incomplete}"
        )


def checkpoint_layers(dtypes: dict[str, str]) -> tuple[list[str], list[str]]:
    """(quantized, float) ``prefix.weight`` names of the layers a checkpoint's tensor
    dtypes describe: a layer is quantized when it has a ``weight_scale``."""
    scaled = {n.removesuffix(".weight_scale") for n in dtypes if n.endswith(".weight_scale")}
    quantized = sorted(f"{p}.weight" for p in scaled)
    floats = sorted(
        n
        for n, dtype in dtypes.items()
        if n.endswith(".weight")
        and n.removesuffix(".weight") not in scaled
        and not is_quantized_dtype(dtype)
    )
    return quantized, floats


def keep_float_projections(model: Any, dtypes: dict[str, str], dtype: Any) -> list[str]:
    """Turn the quantized projections (and embedding tables) of an abstract `model` that the
    checkpoint left in float (``ignore``d or untargeted layers; its embeddings and LM head,
    which compressed-tensors never quantizes) back to float in `dtype`; returns their
    kernel paths. A fused projection must be all quantized or all float."""
    from flax import nnx

    from xlm.distributed.tensor_parallel import logical_shape
    from xlm.models.layers import Linear, VocabEmbedding

    flat = nnx.to_flat_state(nnx.state(model))
    variables = {".".join(map(str, path)): var for path, var in flat}
    shapes = {p: logical_shape(tuple(v.shape), v.get_metadata()) for p, v in variables.items()}

    def kernels(names: list[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for name in names:
            for target in model.hf_weight_targets(name, shapes):
                var = variables.get(target.param) if target.param else None
                if var is not None and var.get_metadata().get("quantized"):
                    found.setdefault(target.param, []).append(name)
        return found

    quantized, floats = checkpoint_layers(dtypes)
    float_kernels, quantized_kernels = kernels(floats), kernels(quantized)
    mixed = sorted(float_kernels.keys() & quantized_kernels.keys())
    if mixed:
        path = mixed[0]
        raise _unsupported(
            f"a fused projection with quantized and float parts: xlm's {path!r} holds "
            f"{quantized_kernels[path]} (quantized) and {float_kernels[path]} (float)"
        )
    for path, module in nnx.iter_modules(model):
        quantizable = isinstance(module, (Linear, VocabEmbedding))
        if quantizable and ".".join(map(str, (*path, "kernel"))) in float_kernels:
            module.keep_float(dtype)
    return sorted(float_kernels)
