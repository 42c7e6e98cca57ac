"""The float kernel (xlm.ops.cpu_kernels.float_matmul) against XLA's dot on SmolLM2-135M's
projection shapes, float32 and half weights, at one row (the decode matvec) and at many
(a batched decode step, a short prefill), alternating program by program in one process.

    python benchmarks/float_matvec.py [--rows 1,64] [--repeats 20] [--cold-mib 256]
        [--max-copies 64] [--dtypes float32,bfloat16] [--out benchmarks/float_matvec.json]

The projections' kernels are stored [out, in] on CPU (xlm.models.layers.Linear,
FloatMatmul.prefers_out_major) and the tied LM head is the [vocab, hidden] table, so every
shape runs on [n, k] ("n x kT"). Per shape and rows, three programs:
- `kernel`: the kernel on [n, k] (the step's path at 1-8 rows, half weights to 256);
- `xla`: XLA's dot on the same [n, k] weights, widened (the step's path above those rows);
- `xla_kn`: XLA's dot on float32 [k, n] copies: the float32 path before the [out, in]
  layout (FloatMatmul.float32_kernel off), the bar the other two must beat.
Each matmul reads its weights once, so at one row its time is its weight bytes over the
bandwidth it streams at (GB/s columns); at many rows it is compute (GFLOP/s columns). One
jitted program multiplies x by `copies` distinct weight matrices (enough to fill
`--cold-mib` MiB, 8 to `--max-copies` at one row, 2 to it above) in a dependent chain (each product
feeds the next input, so XLA cannot run two at once, as in a decode step), so Python's
dispatch (tens of us, more than a small matvec) is shared and the weights come from DRAM
as in a decode step (whose 0.5 GB of float32 weights do not fit the caches); times are
per matmul. A per-call loop from Python measures dispatch instead: it made the kernel look
2-3x faster than XLA's dot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlm.ops import cpu_kernels

# (k, n): q/o, k/v, gate/up, down, the tied LM head ([vocab, hidden]); all stored [n, k].
# (576, 960) is q | k | v in one matrix (xlm keeps them apart for Llama-style checkpoints):
# what one call would cost against the three.
SHAPES = [(576, 576), (576, 192), (576, 960), (576, 3072), (1536, 576), (576, 49152)]
# At most this many copies in one program (`--max-copies`). At 64 the small shapes' copies
# (192 x 576: 28 MiB in float32, 14 in bfloat16) fit the dev CPU's 32 MiB L3, so those rows
# read partly from L3 where a step's 0.27-0.54 GB of weights come from DRAM: compare them
# within a run only. A cap of 200 takes them out of L3 but adds its own cost per call
# (200-call programs, alternating with the XLA ones, ran every shape 1.3-2x slower than an
# ad hoc kernel-only chain of 200 did; session 16).
MAX_COPIES = 64


def xla_dot(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """What FloatMatmul.forward_native runs: the weights widened, then XLA's dot."""
    if transposed:
        return jnp.einsum("mk,nk->mn", x, w.astype(jnp.float32))
    return x @ w.astype(jnp.float32)


def ab(
    m: int, k: int, n: int, dtype: str, repeats: int, cold_bytes: int, max_copies: int = MAX_COPIES
) -> dict:
    """Seconds per matmul of the kernel and of XLA's dot on [n, k], and of XLA's dot on
    float32 [k, n] copies, at `m` rows (medians over `repeats` programs that alternate)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    nbytes = k * n * jnp.dtype(dtype).itemsize
    copies = min(max_copies, max(8 if m == 1 else 2, -(-cold_bytes // nbytes)))
    ws = tuple(jnp.asarray(rng.standard_normal((n, k)), dtype) for _ in range(copies))

    def chain(matmul):  # x through every copy, each product feeding the next input
        def run(x, ws):
            total = jnp.zeros((), jnp.float32)
            for w in ws:
                y = matmul(x, w)
                total = total + y[0, 0]
                x = x + (y[:, :1] > 1e30).astype(x.dtype)  # a dependency; the values stay
            return total

        return jax.jit(run)

    kern = chain(lambda x, w: cpu_kernels.float_matmul(x, w, transposed=True))
    xla = chain(lambda x, w: xla_dot(x, w, True))
    xla_kn = chain(lambda x, w: xla_dot(x, w, False))
    ws_kn = tuple(jnp.asarray(w.astype(jnp.float32).T) for w in ws)
    want = cpu_kernels.float_matmul_reference(x, ws[0], transposed=True)
    np.testing.assert_allclose(
        cpu_kernels.float_matmul(x, ws[0], transposed=True), want, rtol=1e-4, atol=1e-3
    )
    programs = {"kernel": (kern, ws), "xla": (xla, ws), "xla_kn": (xla_kn, ws_kn)}
    times: dict[str, list[float]] = {name: [] for name in programs}
    for fn, weights in programs.values():
        fn(x, weights).block_until_ready()  # compile
    for _ in range(repeats):
        for name, (fn, weights) in programs.items():
            t = time.perf_counter()
            fn(x, weights).block_until_ready()
            times[name].append((time.perf_counter() - t) / copies)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    flops = 2 * m * k * n
    return {
        "rows": m,
        "k": k,
        "n": n,
        "dtype": dtype,
        "weight_bytes": nbytes,
        "copies": copies,
        **{f"{name}_s": t for name, t in med.items()},
        **{f"{name}_gbps": nbytes / t / 1e9 for name, t in med.items()},
        **{f"{name}_gflops": flops / t / 1e9 for name, t in med.items()},
    }


def main() -> None:
    """Print the A/B table and write it as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64", help="rows of x (tokens in the step)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cold-mib", type=int, default=256)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-copies", type=int, default=MAX_COPIES)
    ap.add_argument("--out", default="benchmarks/float_matvec.json")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are unavailable here")
    rows = []
    load_before = os.getloadavg()
    print(
        f"{'rows':>5} {'shape':>11} {'dtype':>8} {'kernel us':>9} {'xla us':>9} "
        f"{'xla[k,n] us':>11} {'kern GB/s':>9} {'kern GF/s':>9} {'xla GF/s':>8} "
        f"{'kern/xla[k,n]':>13}"
    )
    for m in (int(r) for r in args.rows.split(",")):
        for dtype in args.dtypes.split(","):
            for k, n in SHAPES:
                r = ab(m, k, n, dtype, args.repeats, args.cold_mib << 20, args.max_copies)
                rows.append(r)
                print(
                    f"{m:5d} {f'{n}x{k}T':>11} {dtype:>8} {r['kernel_s'] * 1e6:9.1f} "
                    f"{r['xla_s'] * 1e6:9.1f} {r['xla_kn_s'] * 1e6:11.1f} "
                    f"{r['kernel_gbps']:9.2f} {r['kernel_gflops']:9.1f} {r['xla_gflops']:8.1f} "
                    f"{r['xla_kn_s'] / r['kernel_s']:13.2f}",
                    flush=True,
                )
    record = {
        "command": "python benchmarks/float_matvec.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "cold_mib": args.cold_mib,
        "repeats": args.repeats,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
