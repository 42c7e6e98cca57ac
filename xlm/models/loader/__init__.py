"""Weight loading: build the model abstractly, then place each checkpoint tensor directly.

A format is a config loader plus a function yielding (hf_name, numpy array) one tensor at
a time; the model maps HF names onto its parameters (`hf_weight_targets`). Each tensor is
converted and `jax.device_put` where it belongs before the next is read, so no second
full copy of the weights exists in host memory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from xlm import disk_cache, envs, platforms
from xlm.config import XlmConfig, set_current_xlm_config
from xlm.logger import init_logger
from xlm.metrics import startup
from xlm.models.classifier import as_seq_cls_model
from xlm.models.loader import placed_cache
from xlm.models.loader.compressed_tensors import (
    compressed_tensors_weights,
    keep_float_projections,
    quantization_config,
    resolve_quantization,
)
from xlm.models.loader.dummy_format import dummy_values
from xlm.models.loader.gguf import iter_gguf_tensors
from xlm.models.loader.gguf_config import cached_gguf_config
from xlm.models.loader.gguf_quants import QuantizedWeight
from xlm.models.loader.placement import (
    WeightPlacer,
    is_scale,
    min_path,
    scale_path,
    sharding_for,
    stored_dtype,
    stored_layout,
)
from xlm.models.loader.safetensors_format import (
    count_safetensors_tensors,
    iter_safetensors_tensors,
    safetensors_dtypes,
)
from xlm.models.registry import ModelRegistry, base_model_lm
from xlm.plugins import load_general_plugins
from xlm.quantization import PER_CHANNEL, dequantize_weight

logger = init_logger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_load_format(model: str, load_format: str) -> str:
    """ "auto" -> "gguf" for a .gguf path, else "safetensors"."""
    if load_format != "auto":
        return load_format
    return "gguf" if model.endswith(".gguf") else "safetensors"


def load_hf_config(model: str, load_format: str = "auto") -> Any:
    """The transformers config of a model directory, or its snapshot for a GGUF file."""
    # An engine reads its model's config first: the kernels compile from here on.
    _start_cpu_kernels_build()
    # The config comes from what the path is, whatever the weights' format: a dummy load
    # (`xlm plan`, benchmarks) of a GGUF file reads the GGUF's metadata.
    if resolve_load_format(model, load_format) == "gguf" or model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"GGUF file {model!r} does not exist")
        # A snapshot of the transformers config, cached: no transformers import when warm.
        return cached_gguf_config(model)
    if not os.path.isdir(model):
        raise FileNotFoundError(
            f"Model {model!r} is not a directory: expected a Hugging Face checkpoint "
            "directory (config.json + *.safetensors) or a .gguf file"
        )
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"No config.json in model directory {model!r}")
    import transformers

    return expose_text_config(transformers.AutoConfig.from_pretrained(model))


def expose_text_config(config: Any) -> Any:
    """A vision-language config (text_config + vision_config) answers its language
    model's attributes (vocab_size, hidden_size, num_hidden_layers, ...) itself, so the
    engine reads it as any decoder's; the model reads the parts."""
    text = getattr(config, "text_config", None)
    if text is None or getattr(config, "vision_config", None) is None:
        return config
    for key, value in text.to_dict().items():
        if key.startswith("_") or key in ("architectures", "model_type"):
            continue
        try:
            getattr(config, key)
        except AttributeError:
            setattr(config, key, value)
    return config


def resolve_dtype(dtype: str, hf_config: Any) -> Any:
    """The model's (activations') dtype: explicit names as given, but float32 for a half
    dtype where the platform has no fast bf16 (its weights are half: resolve_weight_dtype);
    "auto" from platform and checkpoint."""
    if resolve_weight_dtype(dtype) is not None:
        return jnp.float32
    if dtype != "auto":
        return _DTYPES[dtype]

    if not platforms.current_platform.supports_fast_bf16:
        return jnp.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    ckpt = str(ckpt).removeprefix("torch.") if ckpt is not None else "float32"
    # float32 checkpoints serve in bfloat16 where bfloat16 is fast.
    return _DTYPES.get(ckpt, jnp.bfloat16) if ckpt != "float32" else jnp.bfloat16


def resolve_weight_dtype(dtype: str) -> Any:
    """The dtype float projections and embeddings are stored in when it is not the
    activations': --dtype float16/bfloat16 where bfloat16 math is slow (CPU), whose
    kernels widen half weights to float32 as they read them; else None."""
    if dtype in ("float16", "bfloat16") and not platforms.current_platform.supports_fast_bf16:
        return _DTYPES[dtype]
    return None


def _tensor_source(
    model: str, load_format: str, keep_quantized: bool = False, cache: bool = True
) -> tuple[Iterator[tuple[str, Any]], int]:
    """(name, tensor) pairs of a checkpoint and their count (None: unknown). `cache`: a
    GGUF read without a dequantized copy in the cache gets one after the first step."""
    if load_format == "safetensors":
        return iter_safetensors_tensors(model), count_safetensors_tensors(model)
    if load_format == "gguf" and keep_quantized:  # decoding is fast: no cached copy
        return iter_gguf_tensors(model, keep_quantized=True), None
    if load_format == "gguf":
        cached = _dequantized_gguf_dir(model, write=False)
        if cached is not None:
            return iter_safetensors_tensors(cached), count_safetensors_tensors(cached)
        # Writing the copy (and fsyncing it) is not needed for the first token: the GGUF
        # is dequantized in memory now and the copy written after the first step.
        startup.note("weights", "GGUF dequantized; cached after the first step")
        if cache:
            startup.defer("the dequantized GGUF's cache", lambda: _dequantized_gguf_dir(model))
        return iter_gguf_tensors(model), None
    raise ValueError(f"load_format={load_format!r} has no tensor source")


def _dequantized_gguf_dir(path: str, write: bool = True) -> str | None:
    """A float32 safetensors copy of a GGUF's weights under XLM_CACHE_ROOT (made once).

    Dequantizing a GGUF takes seconds on every start; the saved copy is memory-mapped.
    Keyed by xlm's version, the converter's source, and the file's path, size and mtime;
    written and checked through xlm.disk_cache (atomic, 0700, a manifest of sizes), plus
    a check of the safetensors header, so a truncated or corrupt copy is rebuilt. None
    (load the GGUF directly) when the cache cannot be written, or is not there and not
    `write`.
    """
    from xlm import disk_cache, envs
    from xlm.models.loader import gguf

    path = os.path.abspath(path)
    stat = os.stat(path)
    converter = disk_cache.source_fingerprint(gguf.__file__)
    key = disk_cache.cache_key(path, stat.st_size, stat.st_mtime_ns, converter)
    cache_dir = os.path.join(envs.XLM_CACHE_ROOT, "gguf_weights", key)
    weights = os.path.join(cache_dir, "model.safetensors")
    if disk_cache.check_directory(cache_dir):
        if _safetensors_complete(weights):
            startup.note("weights", "dequantized GGUF from the cache")
            return cache_dir
        logger.warning("Rebuilding the corrupt dequantized-weights cache %s.", cache_dir)
        disk_cache.discard(cache_dir)
    if not write:
        return None
    try:
        logger.info("Dequantizing %s once into %s.", path, cache_dir)
        with disk_cache.atomic_directory(cache_dir) as tmp:
            gguf.gguf_to_safetensors(path, str(tmp))
    except OSError as e:
        logger.warning("Could not cache the dequantized GGUF weights (%s).", e)
        return cache_dir if disk_cache.check_directory(cache_dir) else None
    return cache_dir


def _safetensors_complete(path: str) -> bool:
    """Whether a safetensors file's header parses and its data ends where the file does."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > os.path.getsize(path):
                return False
            header = json.loads(f.read(n))
        end = max(
            (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0
        )
        return os.path.getsize(path) == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False


def _progress(iterable: Any, total: int | None, desc: str) -> Any:
    return tqdm(iterable, total=total, desc=desc, disable=envs.XLM_DISABLE_PROGRESS_BARS)


def load_weights(
    model: nnx.Module,
    tensors: Iterator[tuple[str, np.ndarray]],
    *,
    dtype: Any,
    mesh: Mesh | None = None,
    total: int | None = None,
    headless: bool = False,
) -> nnx.Module:
    """Fill an abstract model from (hf_name, array) pairs; raise on missing or unused tensors.

    `headless`: a base-model checkpoint, which has no language-model head; the head's
    parameters are zeros (a pooling runner never computes logits).
    """
    graphdef, flat, variables = _split(model)
    placer = WeightPlacer(variables, dtype, mesh)
    unused = []
    for name, array in _progress(tensors, total, "Loading weights"):
        targets = model.hf_weight_targets(name, placer.shapes)
        if not targets:
            unused.append(name)
            continue
        for target in targets:
            if not target.param:
                continue
            if isinstance(array, QuantizedWeight):
                _place_quantized(placer, name, target, array)
                continue
            value = np.swapaxes(array, -1, -2) if target.transpose else array
            placer.place(name, target.param, target.index, value, target.transpose)
    for path in lora_paths(variables):  # adapter slots start empty
        placer.place_zeros(path)
    missing = sorted(set(variables) - set(placer.placed))
    if headless:
        for path in [m for m in missing if m.startswith("lm_head.")]:
            placer.place_zeros(path)
            missing.remove(path)
    if missing or unused:
        raise ValueError(
            "Checkpoint does not match the model: "
            f"parameters never loaded: {missing or 'none'}; "
            f"checkpoint tensors never used: {sorted(unused) or 'none'}"
        )
    return _merge(graphdef, flat, placer.placed)


def _place_quantized(placer: WeightPlacer, name: str, target: Any, weight: QuantizedWeight) -> None:
    """A weight kept quantized (a GGUF's, a compressed-tensors checkpoint's): codes, scales
    and minimums to the kernel's parameters (already in the kernel's [in, out] layout; a
    fused target fills its columns of each). A parameter xlm keeps in float (MoE expert
    stacks, `quantize=False` projections) gets the weight dequantized, exactly."""
    if target.param not in placer.variables:
        raise KeyError(f"checkpoint tensor {name!r} maps to unknown parameter {target.param!r}")
    if not placer.variables[target.param].get_metadata().get("quantized"):
        value = dequantize_weight(weight.codes, weight.scale, weight.minimum)
        placer.place(name, target.param, target.index, value, transposed=True)
        return
    scales = scale_path(target.param)
    groups = placer.shapes[scales][0]
    if weight.shape[0] // groups != weight.group_size:  # a coarser type in a finer layout
        weight = weight.regroup(weight.shape[0] // groups)
    placer.place(name, target.param, target.index, weight.codes)
    placer.place(name, scales, target.index, weight.scale)
    if min_path(target.param) in placer.variables:
        minimum = weight.minimum if weight.minimum is not None else np.zeros_like(weight.scale)
        placer.place(name, min_path(target.param), target.index, minimum)


def _merge(graphdef: Any, flat: Any, values: dict[str, jax.Array]) -> nnx.Module:
    for path, var in flat:
        var.set_value(values[".".join(map(str, path))])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_dummy_weights(
    model: nnx.Module, *, dtype: Any, seed: int, mesh: Mesh | None = None
) -> nnx.Module:
    """Fill an abstract model with deterministic random weights."""
    graphdef, flat, variables = _split(model)
    placer = WeightPlacer(variables, dtype, mesh)
    empty = set(lora_paths(variables))
    for path in empty:  # adapter slots start empty
        placer.place_zeros(path)
    drawn = [  # scales are made as their kernels are quantized
        (p, placer.shapes[p]) for p in variables if p not in empty and not is_scale(variables[p])
    ]
    values = dummy_values(drawn, seed)
    for path, value in _progress(values, len(drawn), "Dummy weights"):
        placer.place(path, path, None, value)
    return _merge(graphdef, flat, placer.placed)


def lora_paths(variables: dict[str, nnx.Variable]) -> list[str]:
    """The LoRA slot arrays among a model's parameters (xlm.models.layers.LoRAWeight)."""
    return [p for p, v in variables.items() if "lora_parts" in v.get_metadata()]


def build_abstract_model(
    model_cls: Callable[..., nnx.Module], hf_config: Any, dtype: Any, seed: int = 0
) -> nnx.Module:
    """The model with ShapeDtypeStruct parameters: no memory, no computation."""
    return nnx.eval_shape(lambda: model_cls(hf_config, dtype=dtype, rngs=nnx.Rngs(seed)))


def abstract_weights(model: nnx.Module, *, dtype: Any, mesh: Mesh) -> nnx.Module:
    """The model with sharded ShapeDtypeStruct parameters on `mesh` (a compile target's
    devices): the shapes and shardings loading would give, no bytes read or allocated."""
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    values = {}
    for path, var in flat:
        shape = tuple(var.shape)
        sharding = sharding_for(var, shape, mesh)
        values[".".join(map(str, path))] = jax.ShapeDtypeStruct(
            shape, stored_dtype(var, dtype), sharding=sharding
        )
    return _merge(graphdef, flat, values)


def _in_model(name: str) -> str:
    """A base model's tensor name (they are named without the "model." prefix) as its
    language model's."""
    return name if name.startswith("model.") else f"model.{name}"


def get_model(
    xlm_config: XlmConfig, mesh: Mesh | None = None, abstract: bool = False
) -> nnx.Module:
    """Read the config, build the model abstractly and load its weights (`abstract`: a
    compile target's sharded ShapeDtypeStructs instead; no weights are read)."""
    from xlm.ops import cpu_kernels

    kernels = not abstract and _start_cpu_kernels_build()
    model = _load_model(xlm_config, mesh, abstract)
    if kernels:
        # A saved program that calls the kernels loads only once they are registered.
        cpu_kernels.available()
    return model


def _start_cpu_kernels_build() -> bool:
    """On CPU, start building the native kernels in the background (they compile while
    the config and the weights load); whether this is CPU."""
    if not platforms.current_platform.is_cpu():
        return False
    from xlm.ops import cpu_kernels

    cpu_kernels.start_build()
    return True


def _load_model(xlm_config: XlmConfig, mesh: Mesh | None, abstract: bool) -> nnx.Module:
    load_general_plugins()  # plugins may register architectures; runs once per process
    model_config = xlm_config.model_config
    load_format = resolve_load_format(model_config.model, model_config.load_format)
    hf_config = model_config.hf_config or load_hf_config(model_config.model, load_format)
    model_config.hf_config = hf_config
    model_cls, arch = ModelRegistry.resolve(hf_config)
    if model_config.convert == "classify":
        model_cls = as_seq_cls_model(model_cls)
    # A compressed-tensors checkpoint's scheme (EngineArgs resolves it too; a ModelConfig
    # made directly must not dequantize the checkpoint into float projections).
    model_config.quantization = resolve_quantization(model_config.quantization, hf_config)
    compressed = quantization_config(hf_config) is not None
    if compressed:  # per-channel scales as stored (w8a8: per-token activations)
        model_config.quant_layout = PER_CHANNEL
    dtype = resolve_dtype(model_config.dtype, hf_config)
    model_config.weight_dtype = resolve_weight_dtype(model_config.dtype)
    logger.info(
        "Loading %s (%s) as %s, dtype %s%s%s.",
        model_config.model,
        arch,
        load_format,
        jnp.dtype(dtype).name,
        ""
        if model_config.weight_dtype is None
        else f" ({jnp.dtype(model_config.weight_dtype).name} weights)",
        f", quantization {model_config.quantization}" if model_config.quantization else "",
    )
    with set_current_xlm_config(xlm_config):
        model = build_abstract_model(model_cls, hf_config, dtype, model_config.seed)
    headless = base_model_lm(arch) is not None
    if compressed and load_format == "safetensors":
        dtypes = safetensors_dtypes(model_config.model)
        if headless:
            dtypes = {_in_model(n): d for n, d in dtypes.items()}
        floats = keep_float_projections(model, dtypes, dtype)
        if floats:
            logger.info("Projections the checkpoint left in float: %s.", ", ".join(floats))
    if abstract:
        return abstract_weights(model, dtype=dtype, mesh=mesh)
    if load_format == "dummy":
        return load_dummy_weights(model, dtype=dtype, seed=model_config.seed, mesh=mesh)
    keep_quantized = model_config.quantization == "gguf"
    placed = None  # a GGUF's placed cache entry (xlm.models.loader.placed_cache)
    if load_format == "gguf" and not keep_quantized and placed_cache.applies(mesh):
        variables = _split(model)[2]
        stored = {p: (tuple(v.shape), stored_dtype(v, dtype)) for p, v in variables.items()}
        # The layout too: a square kernel stored [out, in] has its [in, out] shape.
        layouts = {p: (*stored[p], stored_layout(v)) for p, v in variables.items()}
        placed = placed_cache.entry_dir(model_config.model, placed_cache.signature(layouts))
        loaded = _load_placed(model, dtype, placed[0], stored)
        if loaded is not None:
            return loaded
    tensors, total = _tensor_source(
        model_config.model, load_format, keep_quantized, cache=placed is None
    )
    if compressed:  # each quantized layer's codes and scales, as they are stored
        tensors = compressed_tensors_weights(tensors)
    if headless:
        tensors = ((_in_model(n), t) for n, t in tensors)
    loaded = load_weights(model, tensors, dtype=dtype, mesh=mesh, total=total, headless=headless)
    if placed is not None:  # the parameters as placed, saved after the first step
        variables = _split(loaded)[2]
        slots = set(lora_paths(variables))
        arrays = {p: v.get_value() for p, v in variables.items() if p not in slots}
        startup.defer("the placed GGUF weights", lambda: placed_cache.write(*placed, arrays))
    return loaded


def _split(model: nnx.Module) -> tuple[Any, Any, dict[str, nnx.Variable]]:
    """A model's graph definition, flat state, and its parameters by dotted path."""
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    return graphdef, flat, {".".join(map(str, path)): var for path, var in flat}


def _load_placed(
    model: nnx.Module, dtype: Any, directory: str, stored: dict[str, tuple[tuple, np.dtype]]
) -> nnx.Module | None:
    """The abstract model filled from a placed cache entry; None when there is none (or
    it does not hold the parameters as `stored` says they are stored: discarded)."""
    saved = placed_cache.read(directory)
    if saved is None:
        return None
    graphdef, flat, variables = _split(model)
    slots = lora_paths(variables)
    found = {p: (tuple(a.shape), a.dtype) for p, a in saved.items()}
    if found != {p: w for p, w in stored.items() if p not in slots}:
        logger.warning("Discarding the placed-weights cache %s: another model's.", directory)
        disk_cache.discard(directory)
        return None
    placer = WeightPlacer(variables, dtype, None)
    for path, value in saved.items():
        placer.put_placed(path, value)
    for path in slots:  # adapter slots start empty
        placer.place_zeros(path)
    startup.note("weights", "placed GGUF weights from the cache")
    return _merge(graphdef, flat, placer.placed)
