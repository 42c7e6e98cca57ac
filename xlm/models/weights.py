"""Where each Hugging Face checkpoint tensor goes in an xlm model's parameters."""

from __future__ import annotations

import dataclasses

# HF projection name -> (xlm fused parameter, which part of its output columns).
_FUSED_COLUMNS = {
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
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


def column_part(shape: tuple[int, ...], part: int, num_parts: int) -> tuple[slice, ...]:
    """The slice of the last axis holding `part` of `num_parts` equal column blocks."""
    width = shape[-1] // num_parts
    return (*(slice(None),) * (len(shape) - 1), slice(part * width, (part + 1) * width))


def default_weight_targets(
    name: str, param_shapes: dict[str, tuple[int, ...]]
) -> list[WeightTarget]:
    """Map an HF tensor name onto parameters named like HF's modules (empty: unknown)."""
    if name.endswith(IGNORED_SUFFIXES):
        return [WeightTarget.skip()]
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj in _FUSED_COLUMNS:
        fused, part, num_parts = _FUSED_COLUMNS[proj]
        leaf_name = "kernel" if leaf == "weight" else leaf
        path = f"{parent}.{fused}.{leaf_name}"
        if path in param_shapes:
            index = column_part(param_shapes[path], part, num_parts)
            return [WeightTarget(path, index, transpose=leaf == "weight")]
    if leaf == "weight" and f"{module}.kernel" in param_shapes:
        return [WeightTarget(f"{module}.kernel", transpose=True)]
    if name in param_shapes:
        return [WeightTarget(name)]
    return []
