"""Offline throughput and single-request latency: xlm vs transformers, same prompts, one run.

    python benchmarks/throughput.py [--model smollm2-135m] [--num-prompts 64] [--output-len 128]

Prints a table, writes benchmarks/throughput.json, and reports ratios to transformers
plus the batch-1 decode weight-streaming floor (model bytes / measured memory bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# This folder is on the path only while common.py is imported: its kernels.py would shadow
# the `kernels` package that transformers probes for. (Spawned children rerun this.)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE))
from common import HfRunner, XlmRunner, measure_bandwidth, single_request, time_call  # noqa: E402

sys.path.pop(0)


def make_prompts(vocab_size: int, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Skip the low ids, where tokenizers keep their special tokens.
    return [
        rng.integers(100, vocab_size, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)
    ]


def latency(runner, prompt: list[int], output_len: int) -> dict[str, float]:
    """TTFT from a 1-token request; decode tok/s from the extra time of output_len tokens."""
    times = single_request(runner, prompt, output_len, repeats=3)
    ttft, full = min(times["ttft_s"]), min(times["full_s"])
    return {"ttft_s": ttft, "decode_tok_s": (output_len - 1) / (full - ttft)}


# The main install has no torch; with it installed, importing transformers alone takes
# ~3.5 s more, so start times are measured with torch hidden, as on a main-install machine.
START_SNIPPET = """
import time, sys
t0 = time.perf_counter()
sys.modules["torch"] = None
import xlm
llm = xlm.LLM(model=sys.argv[1])
llm.generate("Hello", xlm.SamplingParams(max_tokens=1), use_tqdm=False)
print(time.perf_counter() - t0)
"""


def start_time(model: str, cache_dir: str) -> float:
    env = dict(os.environ, XLM_COMPILATION_CACHE_DIR=cache_dir, XLM_DISABLE_PROGRESS_BARS="1")
    out = subprocess.run(
        [sys.executable, "-c", START_SNIPPET, model],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="alternating xlm/hf rounds")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-start", action="store_true", help="skip cold/warm start")
    parser.add_argument(
        "--start-only",
        action="store_true",
        help="only measure cold and warm start (writes start.json)",
    )
    parser.add_argument("--out", default=str(HERE / "throughput.json"))
    args = parser.parse_args()

    from xlm.models.builtin import resolve_model_name

    if args.start_only:
        with tempfile.TemporaryDirectory() as cache:
            start = {
                "cold_start_s": start_time(args.model, cache),
                "warm_start_s": [start_time(args.model, cache) for _ in range(3)],
            }
        (HERE / "start.json").write_text(json.dumps(start, indent=2))
        print(json.dumps(start, indent=2))
        return

    results: dict[str, object] = {"args": vars(args)}
    bandwidth = measure_bandwidth()
    results["memory_bandwidth_GBps"] = bandwidth / 1e9
    if not args.skip_start:
        with tempfile.TemporaryDirectory() as cache:
            results["cold_start_s"] = start_time(args.model, cache)
            results["warm_start_s"] = start_time(args.model, cache)

    xlm_runner = XlmRunner(args.model, max_num_seqs=args.num_prompts)
    results["xlm_startup_in_process_s"] = xlm_runner.startup_s
    model = xlm_runner.llm.llm_engine.config.model_config
    weight_bytes = sum(
        int(np.prod(x.shape)) * x.dtype.itemsize
        for x in __import__("jax").tree_util.tree_leaves(
            xlm_runner.llm.llm_engine.engine_core.engine_core.executor.model_runner.state
        )
    )
    results["weight_bytes"] = weight_bytes
    results["decode_floor_tok_s"] = bandwidth / weight_bytes
    prompts = make_prompts(xlm_runner.vocab_size, args.num_prompts, args.min_len, args.max_len)
    total_out = args.num_prompts * args.output_len
    hf_runner = None if args.skip_hf else HfRunner(resolve_model_name(model.model))

    rows: dict[str, list[float]] = {"xlm": [], "hf": []}
    for _ in range(args.rounds):
        dt, xlm_out = time_call(xlm_runner.generate, prompts, args.output_len)
        rows["xlm"].append(total_out / dt)
        if hf_runner is not None:
            dt, hf_out = time_call(hf_runner.generate, prompts, args.output_len)
            rows["hf"].append(total_out / dt)
            same = sum(a == b for a, b in zip(xlm_out, hf_out))
            results["greedy_outputs_identical"] = f"{same}/{len(prompts)}"
    results["throughput_tok_s"] = {k: max(v) for k, v in rows.items() if v}
    results["latency"] = {"xlm": latency(xlm_runner, prompts[0], args.output_len)}
    if hf_runner is not None:
        results["latency"]["hf"] = latency(hf_runner, prompts[0], args.output_len)
        results["throughput_ratio"] = rows["xlm"][-1] / rows["hf"][-1]
        results["decode_ratio"] = (
            results["latency"]["xlm"]["decode_tok_s"] / results["latency"]["hf"]["decode_tok_s"]
        )
    results["decode_fraction_of_floor"] = (
        results["latency"]["xlm"]["decode_tok_s"] / results["decode_floor_tok_s"]
    )
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
