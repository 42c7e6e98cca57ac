"""PEFT LoRA directories -> host arrays in the layout of a model's LoRA slots, checked.

A PEFT directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with
``<module>.lora_A.weight`` [r, in] and ``<module>.lora_B.weight`` [out, r] per adapted
projection (module names as the base model's, under ``base_model.model.``). Each module
is mapped onto the model's projections the way the base checkpoint's ``<module>.weight``
is (``hf_weight_targets``), so checkpoint projections fused in xlm (gate | up) land in
their part of the fused projection's rank and columns. B is scaled by alpha / r here
(alpha / sqrt(r) with rsLoRA; per-module ``rank_pattern`` / ``alpha_pattern`` honoured).

Everything a bad adapter can get wrong is refused with ``LoRAAdapterError`` naming the
reason: no or malformed files, a rank above ``max_lora_rank``, a module the model lacks
or does not adapt, wrong shapes, and PEFT features xlm does not serve (DoRA, bias
training, ``modules_to_save``).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flax import nnx

from xlm.distributed.tensor_parallel import logical_shape
from xlm.models.loader.safetensors_format import iter_safetensors_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's prefix of every tensor name (PeftModel wraps the base model twice).
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the reason."""


@dataclass(frozen=True)
class LoRATarget:
    """One projection with LoRA slots: its parameter path and logical sizes."""

    path: str  # e.g. "model.layers.0.mlp.gate_up_proj"
    in_features: int
    out_features: int  # the checkpoint's (logical) width, before any head replication
    parts: int  # checkpoint projections fused into it (gate | up: 2)
    b_metadata: dict[str, Any] = field(hash=False, compare=False)  # B's layout (to_physical)


@dataclass
class LoRASpec:
    """What adapters must fit: the model's LoRA projections and its weight mapping."""

    targets: dict[str, LoRATarget]
    max_rank: int
    weight_targets: Any  # model.hf_weight_targets
    param_shapes: dict[str, tuple[int, ...]]  # logical shapes, as the weight mapping reads

    @classmethod
    def of(cls, model: nnx.Module, max_rank: int) -> LoRASpec:
        flat = nnx.to_flat_state(nnx.state(model))
        variables = {".".join(map(str, p)): v for p, v in flat}
        shapes = {p: logical_shape(tuple(v.shape), v.get_metadata()) for p, v in variables.items()}
        targets = {}
        for path, var in variables.items():
            if not path.endswith(".lora_b"):
                continue
            meta = var.get_metadata()
            linear = path.removesuffix(".lora_b")
            in_features = variables[f"{linear}.lora_a"].shape[0]
            out_features = shapes[path][-1]
            targets[linear] = LoRATarget(
                linear, in_features, out_features, meta["lora_parts"], dict(meta)
            )
        return cls(targets, max_rank, model.hf_weight_targets, shapes)

    def slot_bytes(self, itemsize: int) -> int:
        """Device bytes of one slot (every projection's A and B at the full rank)."""
        total = 0
        for t in self.targets.values():
            rank = t.parts * self.max_rank
            total += rank * (t.in_features + t.out_features)
        return total * itemsize


@dataclass
class LoRAWeights:
    """An adapter on the host: per projection path, (A [in, Rt], B [Rt, out]) logical,
    padded to the slot rank and B scaled; projections it does not adapt are absent."""

    name: str
    rank: int  # the largest module rank
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise LoRAAdapterError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not LORA")
    refusals = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "modules_to_save (fully trained modules) is not supported",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise LoRAAdapterError(f"LoRA adapter {path!r}: {why} ({key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"LoRA adapter {path!r}: trained biases are not supported (bias={config['bias']!r})"
        )
    alpha = config.get("lora_alpha", config.get("r", 8))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: lora_alpha={alpha!r} is not a number")
    return config


def _pattern_value(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's per-module override: the first key matching the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _module_tensors(path: str) -> dict[str, dict[str, np.ndarray]]:
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        other = " (adapter_model.bin is not read: convert it to safetensors)"
        has_bin = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise LoRAAdapterError(
            f"LoRA adapter {path!r} has no {WEIGHTS_FILE}" + (other if has_bin else "")
        )
    modules: dict[str, dict[str, np.ndarray]] = {}
    try:
        for name, array in iter_safetensors_file(weights_path):
            match = _TENSOR.match(name.removeprefix(_PREFIX))
            if match is None:
                raise LoRAAdapterError(
                    f"LoRA adapter {path!r}: tensor {name!r} is not a lora_A / lora_B weight "
                    "(embedding adapters, DoRA magnitudes and biases are not supported)"
                )
            pair = modules.setdefault(match["module"], {})
            pair[match["which"]] = np.asarray(array, np.float32)
    except LoRAAdapterError:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise LoRAAdapterError(
            f"LoRA adapter {path!r}: {WEIGHTS_FILE} is malformed ({e})"
        ) from None
    if not modules:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return modules


def _linear_of(spec: LoRASpec, module: str) -> tuple[LoRATarget, Any]:
    """The projection a checkpoint module feeds, and the slice of its columns."""
    for name in (module, f"model.{module}"):
        for target in spec.weight_targets(f"{name}.weight", spec.param_shapes):
            if target.param.endswith(".kernel"):
                linear = target.param.removesuffix(".kernel")
                if linear in spec.targets:
                    return spec.targets[linear], target.index
    raise LoRAAdapterError(
        f"module {module!r} is not a projection of this model that takes adapters "
        f"(adapted: the attention and MLP projections, e.g. {next(iter(spec.targets), '')!r})"
    )


def load_adapter(path: str, spec: LoRASpec, name: str = "") -> LoRAWeights:
    """Read and check the PEFT adapter in directory `path` against `spec`."""
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter {path!r} is not a directory")
    config = _read_config(path)
    modules = _module_tensors(path)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    max_rank = 0
    for module, pair in sorted(modules.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(f"LoRA adapter {path!r}: module {module!r} has no {missing}")
        a, b = pair["A"], pair["B"]
        try:
            target, index = _linear_of(spec, module)
        except LoRAAdapterError as e:
            raise LoRAAdapterError(f"LoRA adapter {path!r}: {e}") from None
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: module {module!r} has lora_A {a.shape} and lora_B "
                f"{b.shape}: expected [r, in] and [out, r]"
            )
        r = a.shape[0]
        if r > spec.max_rank:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: module {module!r} has rank {r}, above "
                f"max_lora_rank={spec.max_rank}"
            )
        max_rank = max(max_rank, r)
        width = target.out_features // target.parts
        if index is None:
            start, stop = 0, target.out_features
        else:
            cols = index[-1]
            start, stop = cols.start, cols.stop
        if a.shape[1] != target.in_features or b.shape[0] != stop - start:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: module {module!r} has lora_A {a.shape} and lora_B "
                f"{b.shape}; the model's projection needs [r, {target.in_features}] and "
                f"[{stop - start}, r]"
            )
        alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        rank = target.parts * spec.max_rank
        full_a, full_b = weights.get(target.path) or (
            np.zeros((target.in_features, rank), np.float32),
            np.zeros((rank, target.out_features), np.float32),
        )
        bt = b.T * np.float32(scale)
        # Each part of the columns it covers uses its own rank block (a checkpoint that
        # fuses what xlm fuses repeats A in each).
        for part in range(start // width, -(-stop // width)):
            lo, hi = max(start, part * width), min(stop, (part + 1) * width)
            rows = slice(part * spec.max_rank, part * spec.max_rank + r)
            full_a[:, rows] = a.T
            full_b[rows, lo:hi] = bt[:, lo - start : hi - start]
        weights[target.path] = (full_a, full_b)
    return LoRAWeights(name or os.path.basename(os.path.normpath(path)), max_rank, weights)
