"""Weight-only int8 matmul on XLA:CPU: the native kernel against what XLA does by itself.

Usage: python benchmarks/quant_matmul.py [--quick] [--int4-only] [--out ...json]

For each m (rows of x) and (k, n) weight shape, times side by side, interleaved, warm, the
median of repeats of one jitted call each:
- f32:    x @ w_f32 (the float32 weights the int8 ones replace; 4x the bytes),
- cvt:    (x @ w.astype(f32)) * scale, what XLA runs for a weight-only int8 layer,
- w8a8:   lax.dot_general(x_i8, w_i8, preferred_element_type=int32) with x quantized per
          row (token) in the same program, then both scales applied,
- kernel: xlm.ops.cpu_kernels.int8_matmul on all of XLA's intra-op threads,
- kernel1: the same on one thread (the threading gain, and the cost at small shapes).
Shapes: SmolLM2-135M's projections and lm_head, and a Llama-3-8B-like MLP weight. Then the
per-call cost at decode: `--chain` back-to-back calls in one jitted program (a decode step
makes ~200 such calls), per call, against the float32 dot and one elementwise op.

Then packed int4 (`--quantization int4`: codes two per byte, scale and minimum per group of
128 inputs, or 64 where 128 does not divide k) on SmolLM2's projection shapes, through the
quant_matmul op as the engine calls it: `i4native` (forward_native: unpack by shift and
mask, grouped dot, the minimums' term), `i4op` (forward_cpu: the FFI int4 kernel, which adds
the minimums itself), `i4kernel` (the kernel called directly), beside `f32` and the int8
`kernel`.
"""

from __future__ import annotations

import argparse
import functools
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
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xlm.ops import cpu_kernels  # noqa: E402
from xlm.ops.quant_matmul import QuantMatmul  # noqa: E402
from xlm.quantization import int4_group_size, quantize_int4  # noqa: E402

SHAPES = [(576, 576), (576, 192), (576, 3072), (1536, 576), (576, 49152), (4096, 14336)]
ROWS = [1, 8, 64]
CHAIN_SHAPES = [(1, 64), (1, 576), (1, 1536), (8, 576)]  # (m, k = n)
# SmolLM2-135M's quantized projections (q|k|v, o, gate|up, down); the LM head stays float.
INT4_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
INT4_ROWS = [1, 8, 64]


def w8a8(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    x_scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 1e-12) / 127.0
    xq = jnp.clip(jnp.round(x / x_scale), -127, 127).astype(jnp.int8)
    acc = lax.dot_general(xq, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * x_scale * scale[0]


VARIANTS = {
    "f32": jax.jit(lambda x, wf, w, s: x @ wf),
    "cvt": jax.jit(lambda x, wf, w, s: (x @ w.astype(jnp.float32)) * s[0]),
    "w8a8": jax.jit(lambda x, wf, w, s: w8a8(x, w, s)),
    "kernel": jax.jit(lambda x, wf, w, s: cpu_kernels.int8_matmul(x, w, s)),
    "kernel1": jax.jit(lambda x, wf, w, s: cpu_kernels.int8_matmul(x, w, s, max_workers=1)),
}


def interleaved(fns: dict, args: tuple, repeats: int) -> dict[str, float]:
    """Median seconds per call of each fn, the fns alternating within every repeat."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(s) for name, s in samples.items()}


def make_inputs(m: int, k: int, n: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    s = jnp.asarray(rng.uniform(0.001, 0.01, (1, n)), jnp.float32)
    return x, w.astype(jnp.float32) * s, w, s


def bench_shapes(rows: list[int], shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    results = []
    for m in rows:
        for k, n in shapes:
            args = make_inputs(m, k, n)
            big = k * n > (1 << 24)
            times = interleaved(VARIANTS, args, max(3, repeats // 4) if big else repeats)
            row = {"m": m, "k": k, "n": n, **{f"{name}_us": t * 1e6 for name, t in times.items()}}
            # Bytes of weights each must read, per second (w8a8 and cvt read int8 too).
            row["kernel_int8_GBps"] = k * n / times["kernel"] / 1e9
            row["f32_GBps"] = 4 * k * n / times["f32"] / 1e9
            results.append(row)
            print(
                f"m={m:3d} k={k:5d} n={n:6d} "
                + " ".join(f"{name} {row[f'{name}_us']:9.1f}" for name in VARIANTS)
                + f"  f32/kernel {times['f32'] / times['kernel']:5.2f}"
                f"  cvt/kernel {times['cvt'] / times['kernel']:5.2f}"
                f"  kernel {row['kernel_int8_GBps']:5.1f} GB/s",
                flush=True,
            )
    return results


def bench_chain(length: int, repeats: int) -> list[dict]:
    """Per-call time of `length` dependent calls in one jitted program."""

    def chain(op):
        def run(x, w, s):
            for _ in range(length):
                x = op(x, w, s) * 1e-3
            return x

        return jax.jit(run)

    ops = {
        "kernel": (chain(cpu_kernels.int8_matmul), False),
        "kernel1": (chain(lambda x, w, s: cpu_kernels.int8_matmul(x, w, s, max_workers=1)), False),
        "f32": (chain(lambda x, w, s: x @ w), True),
        "elementwise": (chain(lambda x, w, s: jnp.tanh(x)), False),
    }
    results = []
    for m, k in CHAIN_SHAPES:
        x, wf, w, s = make_inputs(m, k, k)
        fns = {
            name: functools.partial(fn, x, wf if wants_f32 else w, s)
            for name, (fn, wants_f32) in ops.items()
        }
        times = interleaved(fns, (), repeats)
        row = {"m": m, "k": k, "n": k}
        row.update({f"{name}_us_per_call": t / length * 1e6 for name, t in times.items()})
        results.append(row)
        print(
            f"chain of {length}: m={m} k=n={k}: "
            + "  ".join(f"{name} {row[f'{name}_us_per_call']:7.2f}" for name in ops)
            + "  (us per call)",
            flush=True,
        )
    return results


def bench_int4(rows: list[int], shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    op = QuantMatmul()
    fns = {
        "f32": jax.jit(lambda x, wf, w8, s8, w4, s4, m4: x @ wf),
        "kernel": jax.jit(lambda x, wf, w8, s8, w4, s4, m4: cpu_kernels.int8_matmul(x, w8, s8)),
        "i4native": jax.jit(lambda x, wf, w8, s8, w4, s4, m4: op.forward_native(x, w4, s4, m4)),
        "i4op": jax.jit(lambda x, wf, w8, s8, w4, s4, m4: op.forward_cpu(x, w4, s4, m4)),
        "i4kernel": jax.jit(
            lambda x, wf, w8, s8, w4, s4, m4: cpu_kernels.int4_matmul(x, w4, s4, m4)
        ),
    }
    results = []
    for m in rows:
        for k, n in shapes:
            x, wf, w8, s8 = make_inputs(m, k, n)
            w4, s4, m4 = quantize_int4(np.asarray(wf), int4_group_size(k))
            args = (x, wf, w8, s8, jnp.asarray(w4), jnp.asarray(s4), jnp.asarray(m4))
            times = interleaved(fns, args, repeats)
            row = {"m": m, "k": k, "n": n, **{f"{name}_us": t * 1e6 for name, t in times.items()}}
            row["i4kernel_GBps"] = k * n / 2 / times["i4kernel"] / 1e9
            results.append(row)
            print(
                f"int4 m={m:3d} k={k:5d} n={n:5d} "
                + " ".join(f"{name} {row[f'{name}_us']:8.1f}" for name in fns)
                + f"  native/op {times['i4native'] / times['i4op']:5.2f}"
                f"  f32/op {times['f32'] / times['i4op']:5.2f}"
                f"  i4kernel {row['i4kernel_GBps']:5.1f} GB/s",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--chain", type=int, default=200, help="calls per program in the chain")
    parser.add_argument("--int4-only", action="store_true", help="only the int4 section")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()
    if not cpu_kernels.available():
        sys.exit("the CPU kernel is unavailable here (see the warning above)")
    rows, shapes, repeats = ROWS, SHAPES, args.repeats
    if args.quick:
        shapes, repeats = SHAPES[:3], 5
    load_before = os.getloadavg()
    print(f"load average before: {load_before}")
    print("times in us (median of interleaved repeats, warm)")
    results = chain = int4 = []
    if not args.int4_only:
        results = bench_shapes(rows, shapes, repeats)
        chain = bench_chain(args.chain, max(3, repeats // 2))
    int4 = bench_int4(INT4_ROWS, INT4_SHAPES, repeats)
    at64 = [r for r in results if r["m"] == 64]
    wins = [r for r in at64 if r["kernel_us"] < r["f32_us"]]
    ratios = ", ".join(f"{r['f32_us'] / r['kernel_us']:.2f}" for r in at64)
    if at64:
        print(
            f"m=64: kernel faster than the float32 dot on {len(wins)}/{len(at64)} shapes; "
            f"f32/kernel = {ratios}"
        )
    load_after = os.getloadavg()
    print(f"load average after: {load_after}")
    report = {
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "command": " ".join(sys.argv),
        "shapes": results,
        "chain": {"length": args.chain, "rows": chain},
        "int4": int4,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
