"""Ragged paged attention: Pallas kernel vs the jnp reference under jit vs the memory floor.

Usage: python benchmarks/kernels.py [--quick] [--out benchmarks/kernels.json]

On GPU it times `ragged_paged_attention_gpu`, on TPU `ragged_paged_attention_tpu`; on CPU there
is no compiled kernel (interpret mode is a correctness tool, not a speed one), so it times only
the reference and says so. The memory floor is (K/V bytes a request must read + Q read + output
written) / bandwidth, with bandwidth measured here by a large on-device copy.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.ragged_paged_attention import (  # noqa: E402
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B-like attention
REFERENCE_GATHER_LIMIT = 16 << 30  # the reference gathers every token's context: skip huge ones


def _time(fn, *args, iters: int) -> float:
    """Median seconds per call of a jitted fn (after one warm-up/compile call)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_bandwidth(nbytes: int) -> float:
    """Device read+write bandwidth in bytes/s from a large elementwise copy."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    return 2 * nbytes / _time(copy, x, iters=10)


def make_inputs(q_lens: list[int], ctx_lens: list[int], dtype, seed: int = 0):
    """Device arrays for one ragged batch; pages are scattered at random over the cache."""
    pages = [-(-c // BLOCK_SIZE) for c in ctx_lens]
    num_blocks = 1 + sum(pages)
    max_pages = max(pages)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(q_lens), max_pages), np.int32)
    used = 0
    for r, p in enumerate(pages):
        tables[r, :p] = perm[used : used + p]
        used += p
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k1, k2 = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(k1, (sum(q_lens), NUM_Q_HEADS, HEAD_DIM), dtype)
    kv = jax.random.normal(k2, (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype)
    meta = (
        jnp.asarray(tables),
        jnp.asarray(ctx_lens, jnp.int32),
        jnp.asarray(qsl),
        jnp.asarray([len(q_lens)], jnp.int32),
    )
    return q, kv, meta


def floor_bytes(q_lens, ctx_lens, itemsize: int) -> int:
    """Bytes that must move: each request's K and V once, Q read, output written."""
    kv = sum(ctx_lens) * 2 * NUM_KV_HEADS * HEAD_DIM * itemsize
    qo = 2 * sum(q_lens) * NUM_Q_HEADS * HEAD_DIM * itemsize
    return kv + qo


def cases(quick: bool) -> list[tuple[str, list[int], list[int]]]:
    """(name, q_lens, ctx_lens) for decode batches and prefill chunks."""
    out = []
    batches = [1, 8, 32] if quick else [1, 8, 32, 64, 128, 256]
    contexts = [512, 2048] if quick else [512, 2048, 8192]
    for ctx in contexts:
        for r in batches:
            out.append((f"decode r={r} ctx={ctx}", [1] * r, [ctx] * r))
    prefill = (
        [(1, 256, 256)]
        if quick
        else [(1, 512, 512), (1, 2048, 2048), (1, 512, 8192), (4, 512, 4096), (8, 256, 2048)]
    )
    for r, chunk, ctx in prefill:
        out.append((f"prefill r={r} chunk={chunk} ctx={ctx}", [chunk] * r, [ctx] * r))
    if not quick:  # a mixed step: 1 prefill chunk plus 63 decodes
        out.append(("mixed 1x512 + 63 decodes ctx=2048", [512] + [1] * 63, [2048] * 64))
    return out


def format_row(row: dict) -> str:
    """One table line; '-' where a column was not measured."""

    def num(value: float | None, width: int) -> str:
        return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}}"

    def gbs(key: str) -> float | None:
        return row["floor_bytes"] / row[key] / 1e3 if key in row else None

    ker, ref = row.get("kernel_us"), row.get("ref_us")
    ratio = f"{ker / row['floor_us']:10.2f}" if ker else f"{'-':>10}"
    speedup = f"{ref / ker:9.2f}" if ker and ref else f"{'-':>9}"
    return (
        f"{row['case']:<36} {num(row['floor_us'], 9)} {num(ref, 9)} {num(gbs('ref_us'), 9)} "
        f"{num(ker, 9)} {num(gbs('kernel_us'), 9)} {ratio} {speedup}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small case set (default on CPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (20; 3 on CPU)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("kernels.json")))
    args = parser.parse_args()

    backend = jax.default_backend()
    device = jax.devices()[0]
    dtype = jnp.float32 if backend == "cpu" else jnp.bfloat16
    itemsize = jnp.dtype(dtype).itemsize
    quick = args.quick or backend == "cpu"
    iters = args.iters or (3 if backend == "cpu" else 20)
    kernel = {"gpu": ragged_paged_attention_gpu, "tpu": ragged_paged_attention_tpu}.get(backend)
    if kernel is None:
        print(f"backend {backend}: no compiled Pallas kernel here; timing the jnp reference only")
    bandwidth = measure_bandwidth((256 << 20) if backend == "cpu" else (2 << 30))
    print(
        f"device: {device.device_kind} ({backend}), dtype {jnp.dtype(dtype).name}, "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, jax {jax.__version__}"
    )

    scale = HEAD_DIM**-0.5
    ref_fn = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=scale))
    ker_fn = jax.jit(functools.partial(kernel, sm_scale=scale)) if kernel else None
    header = (
        f"{'case':<36} {'floor us':>9} {'ref us':>9} {'ref GB/s':>9} {'kern us':>9} "
        f"{'kern GB/s':>9} {'kern/floor':>10} {'ref/kern':>9}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for name, q_lens, ctx_lens in cases(quick):
        q, kv, meta = make_inputs(q_lens, ctx_lens, dtype)
        nbytes = floor_bytes(q_lens, ctx_lens, itemsize)
        floor_s = nbytes / bandwidth
        gather = sum(q_lens) * max(ctx_lens) * 2 * NUM_KV_HEADS * HEAD_DIM * 4
        row = dict(
            case=name,
            q_tokens=sum(q_lens),
            num_reqs=len(q_lens),
            context=max(ctx_lens),
            floor_bytes=nbytes,
            floor_us=floor_s * 1e6,
        )
        # Alternate reference and kernel on the same inputs.
        if gather <= REFERENCE_GATHER_LIMIT:
            row["ref_us"] = _time(ref_fn, q, kv, *meta, iters=iters) * 1e6
        if ker_fn is not None:
            kv_in = kv.transpose(0, 1, 3, 2, 4) if backend == "tpu" else kv
            row["kernel_us"] = _time(ker_fn, q, kv_in, *meta, iters=iters) * 1e6
        rows.append(row)

        print(format_row(row))

    result = dict(
        device=device.device_kind,
        backend=backend,
        dtype=jnp.dtype(dtype).name,
        jax=jax.__version__,
        python=platform.python_version(),
        machine=platform.machine(),
        bandwidth_gbs=bandwidth / 1e9,
        kernel=kernel.__name__ if kernel else None,
        shape=dict(
            num_q_heads=NUM_Q_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK_SIZE,
        ),
        rows=rows,
    )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
