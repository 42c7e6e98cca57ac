"""One layer's attention on CPU: XLA's tiled jnp loop against the native CPU kernel (issue 26).

    python benchmarks/cpu_attention.py [--iters 30] [--out benchmarks/cpu_attention.json]

The engine's attention for a float32 cache on CPU was `xlm.ops.paged_attention.
ragged_paged_attention` (a while loop over 64-token tiles of gathered K/V, about 20
instructions per tile, each a thunk XLA:CPU dispatches on its own); it is now one call of
`xlm.ops.cpu_kernels.paged_attention` per layer. Both are timed here alone, jitted, on the
built-in model's attention shape (9 query heads, 3 KV heads, head_dim 64, 16-token pages,
pages scattered at random), at batch 1, 8 and 64 of decode rows over short and long
contexts, and for prefill chunks; median of `--iters` calls after a warm-up, outputs
compared. A full step runs this 30 times (one per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xlm.ops import cpu_kernels  # noqa: E402
from xlm.ops.paged_attention import AttentionMetadata, ragged_paged_attention  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16  # SmolLM2-135M
SCALE = D**-0.5

# name -> (query rows per request, context length per request)
CASES = {
    "decode b=1 ctx=100": ([1], [100]),
    "decode b=1 ctx=2000": ([1], [2000]),
    "decode b=8 ctx=100": ([1] * 8, [100] * 8),
    "decode b=8 ctx=1000": ([1] * 8, [1000] * 8),
    "decode b=64 ctx=40-200": ([1] * 64, list(range(40, 200, 5))[:64] + [200] * 32),
    "decode b=64 ctx=1000": ([1] * 64, [1000] * 64),
    "prefill 1 x 32": ([32], [32]),
    "prefill 1 x 512": ([512], [512]),
    "mixed 63 decode + 1 x 64 prefill": ([1] * 63 + [64], [150] * 63 + [64]),
}


def make(q_lens: list[int], ctx_lens: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    ctx_lens = ctx_lens[: len(q_lens)]
    pages = [-(-c // BS) for c in ctx_lens]
    num_blocks = 1 + sum(pages)
    max_pages = max(pages)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(q_lens), max_pages), np.int32)
    used = 0
    for r, p in enumerate(pages):
        tables[r, :p] = perm[used : used + p]
        used += p
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(qsl[-1])
    q = rng.standard_normal((tokens, HQ, D), np.float32)
    cache = rng.standard_normal((2, num_blocks, BS, HKV, D), np.float32)
    meta = AttentionMetadata(
        positions=jnp.zeros(tokens, jnp.int32),
        slot_mapping=jnp.zeros(tokens, jnp.int32),
        query_start_loc=jnp.asarray(qsl),
        seq_lens=jnp.asarray(np.asarray(ctx_lens, np.int32)),
        block_tables=jnp.asarray(tables),
        num_seqs=jnp.asarray([len(q_lens)], jnp.int32),
    )
    return jnp.asarray(q), jnp.asarray(cache), meta


def median_us(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=str(Path(__file__).with_name("cpu_attention.json")))
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the xlm CPU kernels are unavailable here (no C++ compiler?)")

    native = jax.jit(lambda q, c, m: ragged_paged_attention(q, c, m, scale=SCALE))
    kernel = jax.jit(
        lambda q, c, m: cpu_kernels.paged_attention(
            q, c, m.block_tables, m.seq_lens, m.query_start_loc, m.num_seqs, sm_scale=SCALE
        )
    )
    load = os.getloadavg()[0]
    rows = []
    for name, (q_lens, ctx_lens) in CASES.items():
        q, cache, meta = make(q_lens, ctx_lens)
        a, b = np.asarray(native(q, cache, meta)), np.asarray(kernel(q, cache, meta))
        diff = float(np.abs(a - b).max())
        t_native = median_us(native, q, cache, meta, iters=args.iters)
        t_kernel = median_us(kernel, q, cache, meta, iters=args.iters)
        rows.append(dict(case=name, native_us=t_native, kernel_us=t_kernel, max_abs_diff=diff))
        print(
            f"| {name} | {t_native:,.0f} | {t_kernel:,.0f} | {t_native / t_kernel:.1f}x "
            f"| {diff:.1e} |",
            flush=True,
        )
    result = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        jax=jax.__version__,
        load_before=load,
        load_after=os.getloadavg()[0],
        shape=dict(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS),
        rows=rows,
    )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
