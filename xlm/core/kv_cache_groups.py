"""KV cache groups: which attention layers share a block table, and which share memory.

A model whose layers attend over different windows (Gemma 2: alternating windowed and
global layers; Gemma 3: five windowed to one global; Qwen2 with max_window_layers) keeps
one block table per group of layers with the same window, so a windowed group can free
the blocks that fell out of its window while a full-attention group keeps them all.

Groups have equal sizes (as vLLM's hybrid KV cache does): the layers of each window are
cut into chunks of `group_size` layers, the size of the smallest window's layer count,
so that layer j of every group shares one physical cache array. One block id then costs
group_size layers' pages wherever it is used, and the pool of block ids is shared by all
groups. A remainder chunk is a smaller group that uses only the first arrays.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers sharing one block table: their window (None: full attention) and indices."""

    sliding_window: int | None
    layer_ids: tuple[int, ...]


def group_layers(windows: list[int | None]) -> list[KVCacheGroupSpec]:
    """Layers' windows -> KV cache groups: full attention first, then windows ascending.

    One window for every layer gives one group of all layers (the single-table layout).
    """
    if not windows:
        return []
    counts = Counter(windows)
    if len(counts) == 1:
        return [KVCacheGroupSpec(windows[0], tuple(range(len(windows))))]
    group_size = min(counts.values())
    order = sorted(counts, key=lambda w: (w is not None, w or 0))
    groups = []
    for window in order:
        layer_ids = [i for i, w in enumerate(windows) if w == window]
        for start in range(0, len(layer_ids), group_size):
            groups.append(KVCacheGroupSpec(window, tuple(layer_ids[start : start + group_size])))
    return groups


def num_kv_cache_arrays(groups: list[KVCacheGroupSpec]) -> int:
    """Physical cache arrays: layer j of every group shares array j."""
    return max((len(g.layer_ids) for g in groups), default=0)


def layer_placement(groups: list[KVCacheGroupSpec]) -> tuple[tuple[int, int], ...]:
    """Per layer, in layer order: (its group, its cache array)."""
    place = {}
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layer_ids):
            place[layer] = (g, j)
    return tuple(place[i] for i in range(len(place)))


def window_block_bound(sliding_window: int, block_size: int, num_new_tokens: int) -> int:
    """Most blocks a windowed group holds during a step that computes num_new_tokens."""
    return -(-(sliding_window - 1 + num_new_tokens) // block_size) + 1


def blocks_for_request(
    groups: list[KVCacheGroupSpec], num_tokens: int, block_size: int, max_step_tokens: int
) -> int:
    """Most blocks one request of num_tokens holds over all groups (steps <= max_step_tokens)."""
    n = -(-num_tokens // block_size)
    return sum(
        n
        if g.sliding_window is None
        else min(n, window_block_bound(g.sliding_window, block_size, max_step_tokens))
        for g in groups
    )
