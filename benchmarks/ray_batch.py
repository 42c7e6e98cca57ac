"""run-batch on Ray Data vs the local run-batch: records/s with 1 and 2 replicas, and the
time Ray adds per batch, on the same records in one run.

    python benchmarks/ray_batch.py [--model tiny] [--num-records 400] [--max-tokens 16]

`--model tiny` (default) writes a tiny random Llama (the tests' one): its steps are so
cheap that the figures show Ray's own cost, which is the point; give a model name or path
(e.g. smollm2-135m) to measure a real model. Throughput is counted from the first batch a
replica takes to the last it returns (engine start excluded, reported apart). Writes
benchmarks/ray_batch.json. Replicas ask Ray for half a CPU each on a local 2-CPU cluster:
on a 2-core machine two replicas share the cores, so 2 replicas cannot be 2x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

ENGINE_FLAGS = [
    "--max-model-len=256",
    "--max-num-seqs=64",
    "--max-num-batched-tokens=256",
    "--kv-cache-memory=0.05",
    "--disable-log-stats",
]


def write_records(path: Path, n: int, max_tokens: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            prompt = " ".join(f"w{(i * 7 + k * 13) % 240}" for k in range(4 + i % 8))
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            body["ignore_eos"] = True
            f.write(
                json.dumps(
                    {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
                )
                + "\n"
            )


def parse(argv: list[str]) -> argparse.Namespace:
    from xlm.entrypoints.cli import build_parser

    return build_parser().parse_args(argv)


async def local_run(args: argparse.Namespace, n: int) -> dict[str, float]:
    """The local run-batch's path (same handlers), timed after the engine is up."""
    from xlm.entrypoints.openai.engine_setup import ServerState, build_engine
    from xlm.entrypoints.run_batch import read_records, run_records

    records = read_records(args.input_file)
    t = time.perf_counter()
    engine, registry = build_engine(args)
    start_s = time.perf_counter() - t
    try:
        state = ServerState(args, engine, registry)
        t = time.perf_counter()
        await run_records(state, records, args.output_file, args.max_concurrency)
        run_s = time.perf_counter() - t
    finally:
        engine.shutdown()
    return {"records": n, "engine_start_s": start_s, "run_s": run_s, "records_per_s": n / run_s}


def ray_run(args: argparse.Namespace) -> dict[str, float]:
    from xlm.ray.batch import run_batch_on_ray

    summary = run_batch_on_ray(args)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-records", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32)
    opts = p.parse_args()
    os.environ.setdefault("XLM_DISABLE_PROGRESS_BARS", "1")

    import ray
    import ray.data

    tmp = Path(tempfile.mkdtemp(prefix="xlm-ray-bench-"))
    model = opts.model
    if model == "tiny":
        from tests.conftest import write_tiny_checkpoint

        model = write_tiny_checkpoint("llama", str(tmp / "tiny-llama"))
    os.environ.setdefault("XLM_COMPILATION_CACHE_DIR", str(tmp / "jax-cache"))
    infile = tmp / "in.jsonl"
    write_records(infile, opts.num_records, opts.max_tokens)
    load = [os.getloadavg()]

    common = ["-i", str(infile), "--model", model, *ENGINE_FLAGS]
    local = asyncio.run(
        local_run(parse(["run-batch", *common, "-o", str(tmp / "local.jsonl")]), opts.num_records)
    )
    load.append(os.getloadavg())

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 1024**2)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    # Start timing batches only once every replica is up: otherwise the first replica
    # ready takes every batch of a short job while the second is still compiling.
    context.wait_for_min_actors_s = 1800
    results: dict[str, dict] = {"local": local}
    try:
        for replicas in (1, 2):
            argv = ["run-batch", "--ray", "--replicas", str(replicas), "--replica-cpus=0.5"]
            argv += ["--ray-batch-size", str(opts.batch_size), *common]
            argv += ["-o", str(tmp / f"ray{replicas}.jsonl")]
            t = time.perf_counter()
            summary = ray_run(parse(argv))
            wall = time.perf_counter() - t
            snapshot = summary["replicas"]
            busy = summary["busy_s"]
            results[f"ray-{replicas}"] = {
                "records": summary["records"],
                "wall_s": wall,
                "run_s": busy,
                "records_per_s": summary["records"] / busy,
                "output_tok_per_s": summary["output_tokens"] / busy,
                "per_replica": snapshot,
            }
            load.append(os.getloadavg())
    finally:
        ray.shutdown()

    batches = opts.num_records / opts.batch_size
    overhead_ms = (results["ray-1"]["run_s"] - local["run_s"]) / batches * 1000
    print(f"{opts.num_records} records, {opts.max_tokens} tokens each, model {opts.model}")
    print(f"{'run':<8} {'records/s':>10} {'run s':>8} {'vs local':>9}")
    for name, r in results.items():
        print(
            f"{name:<8} {r['records_per_s']:>10.1f} {r['run_s']:>8.2f} "
            f"{r['records_per_s'] / local['records_per_s']:>8.2f}x"
        )
    print(
        f"Ray's time per batch of {opts.batch_size} over the local run-batch: {overhead_ms:.0f} ms"
    )
    print(f"load average (1, 5, 15 min) before/after each run: {load}")
    out = {
        "config": vars(opts),
        "results": results,
        "ray_overhead_ms_per_batch": overhead_ms,
        "loadavg": load,
        "cpus": os.cpu_count(),
    }
    (HERE / "ray_batch.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
