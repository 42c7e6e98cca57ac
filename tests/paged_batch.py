"""Test helper: build AttentionMetadata for a ragged paged batch from per-request lists."""

from __future__ import annotations

import dataclasses

import numpy as np

from xlm.ops.paged_attention import AttentionMetadata


@dataclasses.dataclass
class StepRequest:
    """One request's share of a step: its pages, tokens already cached, new tokens."""

    block_table: list[int]
    num_computed: int
    num_new: int


class BlockAllocator:
    """Hands out distinct random blocks (never the null block 0)."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.free = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]

    def allocate(self, n: int) -> list[int]:
        assert len(self.free) >= n, "test ran out of KV blocks"
        out, self.free = self.free[:n], self.free[n:]
        return out


def build_metadata(
    reqs: list[StepRequest],
    block_size: int,
    *,
    num_tokens: int | None = None,
    num_reqs: int | None = None,
    max_blocks: int | None = None,
) -> AttentionMetadata:
    """Arrays the runner builds for one step, padded to the given sizes."""
    total = sum(r.num_new for r in reqs)
    num_tokens = num_tokens or total
    num_reqs = num_reqs or len(reqs)
    max_blocks = max_blocks or max(len(r.block_table) for r in reqs)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)  # padding writes into the null block
    qsl = np.full(num_reqs + 1, total, np.int32)
    seq_lens = np.zeros(num_reqs, np.int32)
    tables = np.zeros((num_reqs, max_blocks), np.int32)
    start = 0
    for i, r in enumerate(reqs):
        pos = np.arange(r.num_computed, r.num_computed + r.num_new)
        assert len(r.block_table) * block_size >= pos[-1] + 1, "request needs more blocks"
        table = np.asarray(r.block_table, np.int32)
        positions[start : start + r.num_new] = pos
        slots[start : start + r.num_new] = table[pos // block_size] * block_size + pos % block_size
        qsl[i] = start
        seq_lens[i] = r.num_computed + r.num_new
        tables[i, : len(table)] = table
        start += r.num_new
    return AttentionMetadata(
        positions=positions,
        slot_mapping=slots,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=tables,
        num_seqs=np.array([len(reqs)], np.int32),
    )
