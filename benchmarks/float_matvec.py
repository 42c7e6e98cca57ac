"""One activation row (the decode matvec): XLA's dot against the few-rows float kernel
(xlm.ops.cpu_kernels.float_matmul) on SmolLM2-135M's projection shapes, float32 and
bfloat16 weights, alternating program by program in one process.

    python benchmarks/float_matvec.py [--repeats 20] [--cold-mib 256]
        [--out benchmarks/float_matvec.json]

Each matmul reads its weights once, so its time is its weight bytes over the bandwidth it
streams at (GB/s column). One jitted program sums x @ w over `copies` distinct weight
matrices (enough to fill `--cold-mib` MiB, 8 to 64), so Python's dispatch (tens of us, more
than a small matvec) is shared and the weights come from DRAM as in a decode step (whose
0.5 GB of float32 weights do not fit the caches); times are per matmul. A per-call loop
from Python measures dispatch instead: it made the kernel look 2-3x faster than XLA's dot.
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


def ab(k: int, n: int, transposed: bool, dtype: str, repeats: int, cold_bytes: int) -> dict:
    """Seconds per matmul of XLA's dot and of the kernel (medians over `repeats` programs
    that alternate), each program the sum over `copies` weight matrices so the Python
    dispatch of one program is shared by many matmuls."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.float32)
    shape = (n, k) if transposed else (k, n)
    nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
    copies = min(64, max(8, -(-cold_bytes // nbytes)))
    ws = tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(copies))

    def over_copies(matmul):  # the sum of x @ w over the copies, one program
        return jax.jit(lambda ws: sum(matmul(x, w) for w in ws))

    xla = over_copies(lambda x, w: xla_dot(x, w, transposed))
    kern = over_copies(lambda x, w: cpu_kernels.float_matmul(x, w, transposed=transposed))
    np.testing.assert_allclose(xla(ws), kern(ws), rtol=1e-3, atol=1e-2 * copies)
    times: dict[str, list[float]] = {"xla": [], "kernel": []}
    for _ in range(repeats):
        for name, fn in (("xla", xla), ("kernel", kern)):
            t = time.perf_counter()
            fn(ws).block_until_ready()
            times[name].append((time.perf_counter() - t) / copies)
    xs, ks = statistics.median(times["xla"]), statistics.median(times["kernel"])
    return {
        "k": k,
        "n": n,
        "transposed": transposed,
        "dtype": dtype,
        "weight_bytes": nbytes,
        "copies": copies,
        "xla_s": xs,
        "kernel_s": ks,
        "xla_gbps": nbytes / xs / 1e9,
        "kernel_gbps": nbytes / ks / 1e9,
    }


def main() -> None:
    """Print the A/B table and write it as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cold-mib", type=int, default=256)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default="benchmarks/float_matvec.json")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are unavailable here")
    rows = []
    print(
        f"{'k x n':>14} {'dtype':>8} {'xla us':>9} {'kernel us':>9} {'xla GB/s':>8} "
        f"{'kern GB/s':>9} {'speedup':>7}"
    )
    for dtype in args.dtypes.split(","):
        for k, n, transposed in SHAPES:
            r = ab(k, n, transposed, dtype, args.repeats, args.cold_mib << 20)
            rows.append(r)
            shape = f"{n}x{k}T" if transposed else f"{k}x{n}"
            print(
                f"{shape:>14} {dtype:>8} {r['xla_s'] * 1e6:9.1f} {r['kernel_s'] * 1e6:9.1f} "
                f"{r['xla_gbps']:8.2f} {r['kernel_gbps']:9.2f} {r['xla_s'] / r['kernel_s']:7.2f}"
            )
    with open(args.out, "w") as f:
        json.dump({"cold_mib": args.cold_mib, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
