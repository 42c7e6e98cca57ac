"""Random ragged paged-attention batches and a brute-force numpy attention for the tests."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Batch:
    """One ragged batch in the layout the kernels take (numpy arrays)."""

    q: np.ndarray  # [T, Hq, D]
    kv_cache: np.ndarray  # [2, NB, BS, Hkv, D]
    block_tables: np.ndarray  # [R, max_blocks] int32
    seq_lens: np.ndarray  # [R] int32
    query_start_loc: np.ndarray  # [R + 1] int32
    num_seqs: np.ndarray  # [1] int32

    def args(self) -> tuple:
        return (
            self.q,
            self.kv_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.num_seqs,
        )


def make_batch(
    rng: np.random.Generator,
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_tokens: int | None = None,
    num_reqs: int | None = None,
    max_blocks: int | None = None,
    spare_blocks: int = 2,
) -> Batch:
    """Requests with the given new-token and total context lengths, pages placed at random."""
    assert all(1 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    n = len(q_lens)
    num_tokens = num_tokens or sum(q_lens)
    num_reqs = num_reqs or n
    pages = [-(-s // block_size) for s in seq_lens]
    max_blocks = max_blocks or max(pages)
    num_blocks = 1 + sum(pages) + spare_blocks
    perm = rng.permutation(np.arange(1, num_blocks))  # block 0 is the null block
    block_tables = np.zeros((num_reqs, max_blocks), np.int32)
    used = 0
    for r, p in enumerate(pages):
        block_tables[r, :p] = perm[used : used + p]
        used += p
    qsl = np.zeros(num_reqs + 1, np.int32)
    qsl[1 : n + 1] = np.cumsum(q_lens)
    qsl[n + 1 :] = qsl[n]
    lens = np.zeros(num_reqs, np.int32)
    lens[:n] = seq_lens
    kv = rng.standard_normal((2, num_blocks, block_size, num_kv_heads, head_dim), np.float32)
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim), np.float32)
    return Batch(q, kv, block_tables, lens, qsl, np.array([n], np.int32))


def case_batch(case: tuple, seed: int, head_dim: int) -> Batch:
    """The batch of a test case (q_lens, seq_lens, num_q_heads, num_kv_heads, block_size,
    padded T, padded R), drawn from `seed`."""
    q_lens, seq_lens, hq, hkv, bs, t, r = case
    return make_batch(
        np.random.default_rng(seed),
        q_lens,
        seq_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        block_size=bs,
        num_tokens=t,
        num_reqs=r,
    )


def brute_force_attention(
    b: Batch, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None
) -> np.ndarray:
    """Dense causal attention per request over its gathered context, in float64."""
    q = np.asarray(b.q, np.float64)
    kv = np.asarray(b.kv_cache, np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv.shape[2], kv.shape[3]
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for r in range(int(b.num_seqs[0])):
        start, end = b.query_start_loc[r], b.query_start_loc[r + 1]
        ctx = int(b.seq_lens[r])
        positions = np.arange(ctx)
        blocks = b.block_tables[r, positions // block_size]
        k = kv[0, blocks, positions % block_size]  # [ctx, Hkv, D]
        v = kv[1, blocks, positions % block_size]
        for i, t in enumerate(range(start, end)):
            pos = ctx - (end - start) + i
            for h in range(num_q_heads):
                logits = k[:, h // group] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                allowed = positions <= pos
                if sliding_window is not None:
                    allowed &= positions > pos - sliding_window
                logits = np.where(allowed, logits, -np.inf)
                p = np.exp(logits - logits.max())
                out[t, h] = (p / p.sum()) @ v[:, h // group]
    return out
