"""Where each Hugging Face checkpoint tensor goes in an xlm model's parameters."""

from __future__ import annotations

import dataclasses

# HF projection name -> (xlm fused parameter, which part of its output columns): a gated
# MLP's gate and up halves, and attention's q, k and v where xlm merges them into one
# qkv_proj (xlm.models.layers.Attention: q's num_heads * head_dim columns, then k's and
# v's num_kv_heads * head_dim each).
_FUSED_COLUMNS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
}
# Buffers some checkpoints carry that are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclasses.dataclass(frozen=True)
class WeightTarget:
    """One destination of a checkpoint tensor: a parameter path and the slice it fills."""

    param: str  # dotted parameter path, e.g. "model.layers.0.mlp.gate_up_proj.kernel"
    index: tuple[slice | int, ...] | None = None  # None: the whole parameter
    transpose: bool = False  # HF Linear weights are [out, in]; xlm kernels are [in, out]

    @classmethod
    def skip(cls) -> WeightTarget:
        """A tensor consumed on purpose without loading (e.g. a tied lm_head copy)."""
        return cls(param="")


def column_range(shape: tuple[int, ...], start: int, stop: int) -> tuple[slice, ...]:
    """The index of columns [start, stop) of the last axis of an array of `shape`."""
    return (*(slice(None),) * (len(shape) - 1), slice(start, stop))


def column_part(shape: tuple[int, ...], part: int, num_parts: int) -> tuple[slice, ...]:
    """The slice of the last axis holding `part` of `num_parts` equal column blocks."""
    width = shape[-1] // num_parts
    return column_range(shape, part * width, (part + 1) * width)


def fused_column_widths(
    fused_path: str, param_shapes: dict[str, tuple[int, ...]]
) -> tuple[int, ...]:
    """The widths of the parts of a fused kernel's (or its scales', biases') output
    columns: gate_up_proj's two equal halves; qkv_proj's q, k, v, where q is as wide as
    the sibling o_proj's input (num_heads * head_dim) and k and v split the rest."""
    module, _, _ = fused_path.rpartition(".")
    parent, _, fused = module.rpartition(".")
    total = param_shapes[fused_path][-1]
    if fused == "gate_up_proj":
        return (total // 2, total // 2)
    q = param_shapes[f"{parent}.o_proj.kernel"][0]
    if (total - q) % 2 or q >= total:
        raise ValueError(f"{fused_path}: {total} columns do not hold q ({q}) and equal k, v")
    return (q, (total - q) // 2, (total - q) // 2)


def default_weight_targets(
    name: str, param_shapes: dict[str, tuple[int, ...]]
) -> list[WeightTarget]:
    """Map an HF tensor name onto parameters named like HF's modules (empty: unknown)."""
    if name.endswith(IGNORED_SUFFIXES):
        return [WeightTarget.skip()]
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj in _FUSED_COLUMNS:
        fused, part = _FUSED_COLUMNS[proj]
        leaf_name = "kernel" if leaf == "weight" else leaf
        path = f"{parent}.{fused}.{leaf_name}"
        if path in param_shapes:
            widths = fused_column_widths(path, param_shapes)
            start = sum(widths[:part])
            index = column_range(param_shapes[path], start, start + widths[part])
            return [WeightTarget(path, index, transpose=leaf == "weight")]
    if leaf == "weight" and f"{module}.kernel" in param_shapes:
        return [WeightTarget(f"{module}.kernel", transpose=True)]
    if name in param_shapes:
        return [WeightTarget(name)]
    return []
