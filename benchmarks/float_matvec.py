"""XLA's dot against the float kernel (xlm.ops.cpu_kernels.float_matmul) on SmolLM2-135M's
projection shapes, float32 and half weights, at one row (the decode matvec) and at many
(a batched decode step, a short prefill), alternating program by program in one process.

    python benchmarks/float_matvec.py [--rows 1,64] [--repeats 20] [--cold-mib 256]
        [--dtypes float32,bfloat16] [--out benchmarks/float_matvec.json]

Each matmul reads its weights once, so at one row its time is its weight bytes over the
bandwidth it streams at (GB/s columns); at many rows it is compute (GFLOP/s columns). One
jitted program sums x @ w over `copies` distinct weight matrices (enough to fill
`--cold-mib` MiB, 8 to 64 at one row, 2 to 64 above), so Python's dispatch (tens of us, more
than a small matvec) is shared and the weights come from DRAM as in a decode step (whose
0.5 GB of float32 weights do not fit the caches); times are per matmul. A per-call loop
from Python measures dispatch instead: it made the kernel look 2-3x faster than XLA's dot.
For half weights a third program, XLA's dot on the same weights in float32 (the float32
engine's path), is the bar: `kern/f32` > 1 means the half-weight step's matmul is faster
than float32's. Above 8 rows the kernel widens each weight tile once into a float32
buffer (its packed path); FloatMatmul takes it for half weights up to
HALF_KERNEL_MAX_ROWS rows.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlm.ops import cpu_kernels

# (k, n, transposed): q/o, k/v, gate/up, down, the tied LM head ([vocab, hidden]).
SHAPES = [
    (576, 576, False),
    (576, 192, False),
    (576, 1536, False),
    (1536, 576, False),
    (576, 49152, True),
]


def xla_dot(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """What FloatMatmul.forward_native runs: the weights widened, then XLA's dot."""
    if transposed:
        return jnp.einsum("mk,nk->mn", x, w.astype(jnp.float32))
    return x @ w.astype(jnp.float32)


def ab(m: int, k: int, n: int, transposed: bool, dtype: str, repeats: int, cold_bytes: int) -> dict:
    """Seconds per matmul of XLA's dot and of the kernel at `m` rows (medians over
    `repeats` programs that alternate), and of XLA's dot on float32 copies of half
    weights; each program the sum over `copies` weight matrices so the Python dispatch of
    one program is shared by many matmuls."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    shape = (n, k) if transposed else (k, n)
    nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
    copies = min(64, max(8 if m == 1 else 2, -(-cold_bytes // nbytes)))
    ws = tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(copies))

    def over_copies(matmul):  # the sum of x @ w over the copies, one program
        return jax.jit(lambda ws: sum(matmul(x, w) for w in ws))

    xla = over_copies(lambda x, w: xla_dot(x, w, transposed))
    kern = over_copies(lambda x, w: cpu_kernels.float_matmul(x, w, transposed=transposed))
    scale = np.sqrt(k) * copies
    np.testing.assert_allclose(xla(ws), kern(ws), rtol=1e-3, atol=1e-4 * scale)
    programs = {"xla": (xla, ws), "kernel": (kern, ws)}
    if dtype != "float32":
        programs["xla_f32"] = (xla, tuple(w.astype(jnp.float32) for w in ws))
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(repeats):
        for name, (fn, args) in programs.items():
            t = time.perf_counter()
            fn(args).block_until_ready()
            times[name].append((time.perf_counter() - t) / copies)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    flops = 2 * m * k * n
    return {
        "rows": m,
        "k": k,
        "n": n,
        "transposed": transposed,
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
    ap.add_argument("--out", default="benchmarks/float_matvec.json")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are unavailable here")
    rows = []
    print(
        f"{'rows':>5} {'k x n':>11} {'dtype':>8} {'xla us':>9} {'kernel us':>9} {'xla GB/s':>8} "
        f"{'kern GB/s':>9} {'xla GF/s':>8} {'kern GF/s':>9} {'speedup':>7} {'kern/f32':>8}"
    )
    for m in (int(r) for r in args.rows.split(",")):
        for dtype in args.dtypes.split(","):
            for k, n, transposed in SHAPES:
                r = ab(m, k, n, transposed, dtype, args.repeats, args.cold_mib << 20)
                rows.append(r)
                shape = f"{n}x{k}T" if transposed else f"{k}x{n}"
                vs_f32 = r["xla_f32_s"] / r["kernel_s"] if "xla_f32_s" in r else float("nan")
                print(
                    f"{m:5d} {shape:>11} {dtype:>8} {r['xla_s'] * 1e6:9.1f} "
                    f"{r['kernel_s'] * 1e6:9.1f} {r['xla_gbps']:8.2f} {r['kernel_gbps']:9.2f} "
                    f"{r['xla_gflops']:8.1f} {r['kernel_gflops']:9.1f} "
                    f"{r['xla_s'] / r['kernel_s']:7.2f} {vs_f32:8.2f}",
                    flush=True,
                )
    with open(args.out, "w") as f:
        json.dump({"cold_mib": args.cold_mib, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
