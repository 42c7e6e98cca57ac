"""Data-parallel serving: `xlm serve --data-parallel-size 2` (two engine cores, each pinned
to its share of the cores) against one engine on all cores, same model and prompts.

Each configuration is a fresh server (every program compiled before /health); the runs
alternate (dp1, dp2, dp1, dp2, ...) so a machine's drift hits both alike. Per run: output
throughput, request throughput and TTFT (mean, median, p99) at `--concurrency` streamed
requests (the client of benchmarks/serve.py). Prints a table and the DP=2 / DP=1 ratios,
writes JSON.

    python benchmarks/data_parallel.py --model smollm2-135m --concurrency 64 \
        --num-requests 128 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.serve import _versions, launch_server, make_prompts, run_level  # noqa: E402

CONFIGS = {"dp1": [], "dp2": ["--data-parallel-size", "2"]}


def run_config(name: str, args: argparse.Namespace) -> dict:
    """Start a server for one configuration, warm it up, measure one level, stop it."""
    serve_args = f"{args.model} {args.engine_args} {shlex.join(CONFIGS[name])}"
    proc, url = launch_server(serve_args, args.startup_timeout)
    try:
        warm = make_prompts(4, args.input_words, 999)
        asyncio.run(run_level({}, url, args.served_name, warm, 4, 8, args.timeout))
        prompts = make_prompts(args.num_requests, args.input_words, args.seed)
        level = asyncio.run(
            run_level(
                {}, url, args.served_name, prompts, args.concurrency, args.output_len, args.timeout
            )
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    level["config"] = name
    print(
        f"{name}: {level['completed']}/{args.num_requests} ok, "
        f"{level['output_throughput']:.1f} out tok/s, TTFT mean {level['ttft']['mean_ms']:.0f} ms",
        flush=True,
    )
    return level


def summarize(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Median over rounds of each configuration's figures."""
    out: dict[str, dict[str, float]] = {}
    for name in CONFIGS:
        mine = [r for r in runs if r["config"] == name]
        out[name] = {
            "output_throughput": statistics.median(r["output_throughput"] for r in mine),
            "request_throughput": statistics.median(r["request_throughput"] for r in mine),
            "ttft_mean_ms": statistics.median(r["ttft"]["mean_ms"] for r in mine),
            "ttft_median_ms": statistics.median(r["ttft"]["median_ms"] for r in mine),
            "ttft_p99_ms": statistics.median(r["ttft"]["p99_ms"] for r in mine),
            "completed": min(r["completed"] for r in mine),
        }
    return out


def print_table(summary: dict[str, dict[str, float]], concurrency: int) -> None:
    """One row per configuration, then the DP=2 / DP=1 ratios."""
    print(f"concurrency {concurrency} (median over rounds)")
    print(
        f"{'config':>6} {'done':>5} {'out tok/s':>9} {'req/s':>7} "
        f"{'TTFT mean':>9} {'TTFT med':>9} {'TTFT p99':>9}"
    )
    for name, s in summary.items():
        print(
            f"{name:>6} {s['completed']:>5} {s['output_throughput']:>9.1f} "
            f"{s['request_throughput']:>7.2f} {s['ttft_mean_ms']:>9.0f} "
            f"{s['ttft_median_ms']:>9.0f} {s['ttft_p99_ms']:>9.0f}"
        )
    a, b = summary["dp2"], summary["dp1"]
    print(
        f"dp2/dp1: throughput {a['output_throughput'] / b['output_throughput']:.2f}x, "
        f"TTFT mean {a['ttft_mean_ms'] / b['ttft_mean_ms']:.2f}x (ms in the table)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--engine-args",
        default="--max-model-len 512 --max-num-seqs 64 --max-num-batched-tokens 512 "
        "--kv-cache-memory 0.5 --disable-log-stats",
        help="engine flags both configurations get",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-words", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(HERE / "data_parallel.json"))
    args = parser.parse_args()
    args.served_name = args.model

    load_before = os.getloadavg()[0]
    runs = [run_config(name, args) for _ in range(args.rounds) for name in CONFIGS]
    summary = summarize(runs)
    print_table(summary, args.concurrency)
    report = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "versions": _versions(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
