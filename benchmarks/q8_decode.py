"""The int8 kernels at decode, w8a8 (int8 x int8) and weight-only: weights in strips and [k, n].

    python benchmarks/q8_decode.py [--rows 1] [--mib 24] [--repeats 8] [--out FILE]

For each of SmolLM2-135M's weight shapes (the tied LM head [576, 49152] and the layers'
projections), one jitted program multiplies float activations by `copies` distinct weight
matrices (2 to 128, enough to fill `--mib` MiB) in a dependent chain (each call's input
depends on the last one's output, so XLA cannot run two at once, as in a decode step),
groups of 32 rows (w8a8 from float weights). The paths alternate, on one thread and on all
of XLA's intra-op threads:
- `linear`: xlm.ops.cpu_kernels.q8_linear on the weights in strips (the loader's CPU layout,
  xlm.quantization.q8_kernel_strips): the kernel quantizes the activations itself, one
  call per projection (what a step runs);
- `strips`: XLA quantizes (cpu_kernels.quantize_activations), then q8_matmul on strips;
- `bands`, `tiles`: the same on [k, n];
- `int8`, `int8_strips`: the weight-only int8 kernel (float activations, a scale per
  output channel) on [k, n] and in strips; `int8_strips_g32`: in strips with a scale per
  32 inputs (`--quantization int8` on CPU).
Times are per call, the min of the repeats; GB/s = weight bytes / that time. The copies
share one scale array (it stays in cache), so grouped scales' own bytes (12.5% of the
codes' at a float32 scale per 32 inputs) are left out: the figures compare the kernels'
work, and a model's step reads each matrix's scales too. Per call
includes the FFI call and the chain's small fusions, which is what a step pays per
projection.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlm.ops import cpu_kernels
from xlm.quantization import q8_kernel_strips, q8_scale_strips

# SmolLM2-135M's tied LM head and projections, then a tiny weight: what a call costs
# beyond its bytes (the FFI call, the column split, the chain's fusion).
SHAPES = [(576, 49152), (576, 3072), (1536, 576), (576, 960), (576, 576), (32, 64)]


def chain(x, ws, scale, path: str, max_workers: int):
    total = 0.0
    for w in ws:
        if path == "linear":
            y = cpu_kernels.q8_linear(x, w, scale, max_workers=max_workers)
        elif path.startswith("int8"):
            y = cpu_kernels.int8_matmul(x, w, scale, max_workers=max_workers)
        else:
            xq, xs = cpu_kernels.quantize_activations(x, x.shape[1] // 32)
            y = cpu_kernels.q8_matmul(
                xq, xs, w, scale, bands=path == "bands", max_workers=max_workers
            )
        total = total + y[0, 0]
        x = x + (y[:, :1] > 1e30).astype(x.dtype)  # a dependency; the values stay
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--mib", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()
    results = []
    for k, n in SHAPES:
        copies = min(128, max(2, (args.mib << 20) // (k * n)))
        host = [rng.integers(-127, 128, (k, n), dtype=np.int8) for _ in range(copies)]
        scale_host = rng.uniform(0.001, 0.01, (k // 32, n)).astype(np.float32)
        ws, scale = [jnp.asarray(w) for w in host], jnp.asarray(scale_host)
        inputs = {"tiles": (ws, scale), "bands": (ws, scale)}
        if n % 32 == 0:
            strips = [jnp.asarray(np.ascontiguousarray(q8_kernel_strips(w))) for w in host]
            strip_scale = jnp.asarray(np.ascontiguousarray(q8_scale_strips(scale_host)))
            inputs["strips"] = inputs["linear"] = (strips, strip_scale)
        # Weight-only int8 (float x, a scale per output channel) on [k, n] and in strips.
        channel_scale = rng.uniform(0.001, 0.01, (1, n)).astype(np.float32)
        inputs["int8"] = (ws, jnp.asarray(channel_scale))
        if n % 32 == 0:
            inputs["int8_strips"] = (strips, jnp.asarray(q8_scale_strips(channel_scale)))
            # Weight-only in Q8_0's groups of 32 (int8 on CPU): the grouped scales.
            inputs["int8_strips_g32"] = (strips, strip_scale)
        x = jnp.asarray(rng.standard_normal((args.rows, k)).astype(np.float32))
        for workers in (1, 0):
            programs = {
                path: jax.jit(lambda *a, p=path, w=workers: chain(*a, p, w)) for path in inputs
            }
            times: dict[str, list[float]] = {path: [] for path in programs}
            for path, program in programs.items():
                program(x, *inputs[path]).block_until_ready()
            for _ in range(args.repeats):
                for path, program in programs.items():
                    start = time.perf_counter()
                    program(x, *inputs[path]).block_until_ready()
                    times[path].append(time.perf_counter() - start)
            row = {"k": k, "n": n, "rows": args.rows, "workers": workers or "all"}
            for path, ts in times.items():
                per_call = min(ts) / copies
                row[f"{path}_us"] = round(per_call * 1e6, 1)
                row[f"{path}_gbs"] = round(k * n / per_call / 1e9, 2)
            results.append(row)
            print(
                f"{k:5d}x{n:<6d} rows {args.rows} workers {row['workers']:>3}: "
                + "  ".join(
                    f"{path} {row[f'{path}_us']:8.1f} us ({row[f'{path}_gbs']:5.1f} GB/s)"
                    for path in times
                ),
                flush=True,
            )
    if args.out:
        record = {
            "command": "python benchmarks/q8_decode.py "
            + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
