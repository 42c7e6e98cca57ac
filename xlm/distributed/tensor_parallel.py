"""Tensor-parallel layout rules: which widths split over the `model` axis, and how.

Query heads, MLP columns and (Qwen3-MoE) each expert's intermediate width are split
evenly over the tensor-parallel devices. KV heads are split when there are at least as
many as devices; when there are fewer, each KV head is replicated so every device holds
one (vLLM's rule), which keeps attention local to a device.

Two parameter layouts differ from the checkpoint's ("logical") one, and the loader
converts each tensor as it places it (`to_physical`):
- `head_replicas=(r, head_dim)`: the last axis holds heads of `head_dim`; each is
  repeated r times (k/v projections under KV-head replication).
- `fused_shards=(parts, shards)`: the last axis is `parts` equal blocks (gate | up);
  they are interleaved per shard, [gate_0 | up_0 | gate_1 | up_1 ...], so each device's
  slice holds its own gate and up columns and the activation needs no collective.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from xlm.config import get_current_parallel_config


def tp_size() -> int:
    """Tensor-parallel size of the model being built (1 outside of one)."""
    return get_current_parallel_config().tensor_parallel_size


def check_split(what: str, value: int, tp: int) -> None:
    """Raise naming both numbers when `value` cannot be split evenly over `tp` devices."""
    if value % tp:
        raise ValueError(
            f"{what}={value} cannot be split over tensor_parallel_size={tp}: "
            f"tensor_parallel_size must divide {what}"
        )


def kv_head_replicas(num_kv_heads: int, tp: int) -> int:
    """How many copies of each KV head the model holds (1: the heads are split)."""
    if num_kv_heads % tp == 0:
        return 1
    if tp % num_kv_heads == 0:
        return tp // num_kv_heads
    raise ValueError(
        f"num_key_value_heads={num_kv_heads} cannot be split over tensor_parallel_size={tp}: "
        "one must be a multiple of the other (KV heads are split across devices, or "
        "replicated so that each device holds one)"
    )


def logical_shape(shape: tuple[int, ...], metadata: dict[str, Any]) -> tuple[int, ...]:
    """The checkpoint's shape of a parameter stored in `shape` (a w8a8 kernel or its
    scales stored in the CPU kernel's strips, xlm.quantization.q8_kernel_strips: [in, out] or
    [G, out]; a float kernel stored [out, in]: [in, out]; both only without tensor
    parallelism)."""
    if metadata.get("out_major"):  # a float kernel [out, in] (xlm.models.layers.Linear)
        shape = (shape[1], shape[0])
    if metadata.get("q8_strips"):
        if len(shape) == 4:  # kernel [out / 32, in / 4, 32, 4]
            return (shape[1] * shape[3], shape[0] * shape[2])
        return (shape[1], shape[0] * shape[2])  # scale [out / 32, G, 32]
    rep = metadata.get("head_replicas")
    if rep and rep[0] > 1:
        return (*shape[:-1], shape[-1] // rep[0])
    return tuple(shape)


def to_physical(value: np.ndarray, metadata: dict[str, Any]) -> np.ndarray:
    """A checkpoint-layout tensor in the parameter's stored layout (see module doc)."""
    lead = value.shape[:-1]
    rep = metadata.get("head_replicas")
    if rep and rep[0] > 1:
        replicas, head_dim = rep
        heads = value.reshape(*lead, -1, head_dim)
        value = np.repeat(heads, replicas, axis=-2).reshape(*lead, -1)
    fused = metadata.get("fused_shards")
    if fused and fused[1] > 1:
        parts, shards = fused
        blocks = value.reshape(*lead, parts, shards, -1)
        value = np.swapaxes(blocks, -3, -2).reshape(*lead, -1)
    return value
