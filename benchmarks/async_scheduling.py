"""Async scheduling on vs off, alternating in one process on the same weights.

Two engines on the built-in model (one per mode) take turns, repeat after repeat, on
real-text prompts of 16-64 tokens (`peers_prompts.txt`): one request of `--single-len`
greedy tokens and a batch of `--batch` requests of `--batch-len` tokens, EOS ignored.
The first repeat warms both engines and is reported but left out of the medians.

    python benchmarks/async_scheduling.py [--repeats 5] [--out benchmarks/async_scheduling.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

PROMPTS = os.path.join(os.path.dirname(__file__), "peers_prompts.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-len", type=int, default=64)
    parser.add_argument("--single-len", type=int, default=128)
    parser.add_argument("--out", default=None, help="write the per-repeat figures as JSON")
    args = parser.parse_args()

    import xlm

    with open(PROMPTS) as f:
        prompts = [line.strip() for line in f if line.strip()]
    engines = {
        mode: xlm.LLM(
            model=args.model, async_scheduling=mode, max_model_len=512, startup_programs="all"
        )
        for mode in (True, False)
    }
    single = xlm.SamplingParams(temperature=0.0, max_tokens=args.single_len, ignore_eos=True)
    batch = xlm.SamplingParams(temperature=0.0, max_tokens=args.batch_len, ignore_eos=True)
    rows: list[dict] = []
    for repeat in range(args.repeats):
        for mode, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompts[:1], single, use_tqdm=False)
            t_single = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate(prompts[: args.batch], batch, use_tqdm=False)
            t_batch = time.perf_counter() - start
            row = {
                "repeat": repeat,
                "async": mode,
                "single_tok_s": args.single_len / t_single,
                "batch_tok_s": args.batch * args.batch_len / t_batch,
                "load_avg": os.getloadavg()[0],
            }
            rows.append(row)
            print(
                f"repeat {repeat} async={mode}: one request {row['single_tok_s']:.1f} tok/s, "
                f"batch {args.batch} {row['batch_tok_s']:.1f} tok/s "
                f"(load {row['load_avg']:.2f})",
                flush=True,
            )
    for mode in (True, False):
        kept = [r for r in rows if r["async"] is mode and r["repeat"] > 0]
        print(
            f"async={mode}: median one request "
            f"{statistics.median(r['single_tok_s'] for r in kept):.1f} tok/s, batch "
            f"{statistics.median(r['batch_tok_s'] for r in kept):.1f} tok/s"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
