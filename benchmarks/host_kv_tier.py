"""The host KV tier on a repeated-long-prefix workload: TTFT and throughput with and without it.

Two engines on the same model and the same capped device pool (`--device-blocks`, far
fewer than the workload's prefixes need), one with `kv_offloading_size=--host-gib`, take
turns. A round sends `--num-prefixes` requests, each a long prefix of `--prefix-len` tokens
plus a fresh short suffix, so the device pool cannot keep them from one round to the next:
without the tier every round prefills every prefix again, with it the prefixes come back
from host memory. Prompts are real text (peers_prompts.txt). Round 0 fills the tier and is
reported but left out of the medians.

Per engine and round: TTFT (median and p90 of first_token_time - arrival_time over the
batch), the batch's output tok/s, prompt tokens served from the host tier, and bytes moved
each way. At the end, the copy bandwidth of the tier engine's own gather/scatter programs
(64-block chunks, device->host including the host write, host->device including the
scatter), on its real cache arrays.

    python benchmarks/host_kv_tier.py [--rounds 4] [--out benchmarks/host_kv_tier.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def run_round(llm, prompts: list[list[int]], max_tokens: int, xlm) -> dict:
    params = xlm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.get_stats()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.get_stats()
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    return {
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "output_tok_s": len(prompts) * max_tokens / wall,
        "wall_s": wall,
        "host_hit_tokens": after.host_kv_cache_hits - before.host_kv_cache_hits,
        "device_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
        "bytes_to_host": after.host_kv_bytes_to_host - before.host_kv_bytes_to_host,
        "bytes_to_device": after.host_kv_bytes_to_device - before.host_kv_bytes_to_device,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def copy_bandwidth(llm, repeats: int = 5) -> dict:
    """Bytes/s of the tier's copies: 64 blocks out to the host, 64 blocks back in."""
    import jax

    from xlm.core.host_kv_tier import HostKVTransfers

    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    host = runner.host_kv
    n = min(64, host.num_slots, runner.num_blocks - 1)
    blocks, slots = list(range(1, n + 1)), list(range(n))
    block_bytes = llm.llm_engine.engine_core.engine_core.scheduler.host_kv_tier.block_bytes
    out_s, in_s = [], []
    for _ in range(repeats):
        jax.block_until_ready(runner.kv_caches)
        t = time.perf_counter()
        runner.kv_caches = host.apply(runner.kv_caches, HostKVTransfers(blocks, slots))
        host.wait()
        out_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        runner.kv_caches = host.apply(runner.kv_caches, HostKVTransfers([], [], slots, blocks))
        jax.block_until_ready(runner.kv_caches)
        in_s.append(time.perf_counter() - t)
    num_bytes = n * block_bytes
    return {
        "blocks": n,
        "bytes": num_bytes,
        "to_host_GBps": num_bytes / min(out_s) / 1e9,
        "to_device_GBps": num_bytes / min(in_s) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prefixes", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=512)
    parser.add_argument("--host-gib", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the figures as JSON")
    args = parser.parse_args()

    import xlm

    engine = dict(
        max_model_len=args.prefix_len + args.suffix_len + args.max_tokens,
        num_gpu_blocks_override=args.device_blocks,
        max_num_seqs=args.num_prefixes,
        startup_programs="all",
    )
    if args.block_size:
        engine["block_size"] = args.block_size
    engines = {
        "tier": xlm.LLM(model=args.model, kv_offloading_size=args.host_gib, **engine),
        "no_tier": xlm.LLM(model=args.model, **engine),
    }
    # Real text: the peers benchmark's passages, tokenized once and read as one stream; each
    # prefix starts at its own place in it, each round's suffixes at fresh places.
    tokenizer = engines["tier"].get_tokenizer()
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "peers_prompts.txt")) as f:
        text = " ".join(line.strip() for line in f if line.strip() and not line.startswith("#"))
    stream = tokenizer.encode(text, add_special_tokens=False)
    rng = np.random.default_rng(0)

    def span(n: int) -> list[int]:
        start = int(rng.integers(0, len(stream) - n))
        return stream[start : start + n]

    prefixes = [span(args.prefix_len) for _ in range(args.num_prefixes)]
    rows = []
    for r in range(args.rounds):
        prompts = [p + span(args.suffix_len) for p in prefixes]
        tokens = {}
        for name, llm in engines.items():
            row = run_round(llm, prompts, args.max_tokens, xlm)
            tokens[name] = row.pop("tokens")
            rows.append({"round": r, "engine": name, **row, "load_avg": os.getloadavg()[0]})
        rows[-1]["same_tokens"] = rows[-2]["same_tokens"] = tokens["tier"] == tokens["no_tier"]

    print(
        f"{'round':>5} {'engine':>8} {'TTFT med s':>11} {'TTFT p90 s':>11} {'out tok/s':>10} "
        f"{'host hit tok':>13} {'MB to host':>11} {'MB to dev':>10} {'same':>5}"
    )
    for row in rows:
        print(
            f"{row['round']:>5} {row['engine']:>8} {row['ttft_median_s']:>11.3f} "
            f"{row['ttft_p90_s']:>11.3f} {row['output_tok_s']:>10.1f} "
            f"{row['host_hit_tokens']:>13} {row['bytes_to_host'] / 1e6:>11.1f} "
            f"{row['bytes_to_device'] / 1e6:>10.1f} {str(row['same_tokens']):>5}"
        )
    summary = {}
    for name in engines:
        steady = [row for row in rows if row["engine"] == name and row["round"] > 0]
        if steady:
            summary[name] = {
                "ttft_median_s": statistics.median(r["ttft_median_s"] for r in steady),
                "output_tok_s": statistics.median(r["output_tok_s"] for r in steady),
            }
    if len(summary) == 2:
        ttft = summary["tier"]["ttft_median_s"] / summary["no_tier"]["ttft_median_s"]
        tput = summary["tier"]["output_tok_s"] / summary["no_tier"]["output_tok_s"]
        summary["ttft_ratio_tier_over_no_tier"] = ttft
        summary["throughput_ratio_tier_over_no_tier"] = tput
        print(f"steady rounds, tier / no tier: TTFT {ttft:.2f}x, output tok/s {tput:.2f}x")
    bandwidth = copy_bandwidth(engines["tier"])
    print(
        f"copy bandwidth ({bandwidth['blocks']} blocks, {bandwidth['bytes'] / 1e6:.1f} MB): "
        f"device->host {bandwidth['to_host_GBps']:.2f} GB/s, "
        f"host->device {bandwidth['to_device_GBps']:.2f} GB/s"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"args": vars(args), "rows": rows, "summary": summary, "copy": bandwidth},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
