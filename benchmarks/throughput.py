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
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: read + write of a large warm buffer, best of `repeats`."""
    src = np.ones(num_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best


def make_prompts(vocab_size: int, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Skip the low ids, where tokenizers keep their special tokens.
    return [
        rng.integers(100, vocab_size, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)
    ]


class XlmRunner:
    def __init__(self, model: str, max_num_seqs: int) -> None:
        import xlm

        t = time.perf_counter()
        self.llm = xlm.LLM(model=model, max_num_seqs=max_num_seqs)
        self.startup_s = time.perf_counter() - t
        self.xlm = xlm
        self.vocab_size = self.llm.get_tokenizer().vocab_size

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self.xlm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class HfRunner:
    def __init__(self, gguf_path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        d, f = os.path.split(gguf_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=torch.float32
        ).eval()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        pad = 0
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as batched generate needs
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=pad,
            )
        return [row[width:].tolist() for row in out]


def time_call(fn, *args) -> tuple[float, object]:
    t = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t, result


def latency(runner, prompt: list[int], output_len: int) -> dict[str, float]:
    """TTFT from a 1-token request; decode tok/s from the extra time of output_len tokens."""
    ttft = min(time_call(runner.generate, [prompt], 1)[0] for _ in range(3))
    full = min(time_call(runner.generate, [prompt], output_len)[0] for _ in range(2))
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
