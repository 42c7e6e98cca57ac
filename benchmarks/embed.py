"""Embedding throughput: xlm's pooling runner against transformers, same weights, same inputs.

Both embed the built-in SmolLM2-135M (its GGUF weights; transformers reads the same
weights converted to safetensors) into last-token, L2-normalized vectors, float32 on the
CPU. Inputs are real text (`peers_prompts.txt`, joined and cut to exactly 16, 64 and 256
tokens); each length is embedded in one call of `--inputs` inputs, `--repeats` times after
a warm-up call. Each engine runs in its own process, one after the other, from a cold
start (its load time is reported); xlm's compiled programs may come from its on-disk
cache (said in the table). The vectors of both engines are compared (cosine).

    python benchmarks/embed.py [--lengths 16,64,256] [--inputs 128] [--repeats 3]

Prints a table and writes `benchmarks/embed.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "peers_prompts.txt")


def make_inputs(tokenizer, length: int, count: int) -> list[list[int]]:
    """`count` inputs of exactly `length` tokens of real text (distinct starting lines)."""
    lines = [ln.strip() for ln in open(PROMPTS) if ln.strip()]
    ids = [tokenizer.encode(" ".join(lines[i:] + lines[:i])) for i in range(len(lines))]
    return [ids[i % len(ids)][i // len(ids) : i // len(ids) + length] for i in range(count)]


def run_xlm(args: argparse.Namespace, inputs: dict[int, list[list[int]]]) -> dict:
    import xlm

    start = time.perf_counter()
    longest = max(inputs)
    llm = xlm.LLM(
        model="smollm2-135m",
        runner="pooling",
        max_model_len=max(512, longest),
        max_num_seqs=args.inputs,
        max_num_batched_tokens=args.step_tokens,
        startup_programs="all",  # steady state: every program before timing
    )
    load_s = time.perf_counter() - start
    compiled = llm.llm_engine.num_compilations
    out = {"load_s": load_s, "runs": {}, "vectors": {}}
    for length, prompts in inputs.items():
        batch = [{"prompt_token_ids": p} for p in prompts]
        llm.embed(batch[:4], use_tqdm=False)  # warm
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = llm.embed(batch, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        out["runs"][length] = times
        out["vectors"][length] = [r.outputs.data.tolist() for r in res[:8]]
    out["compiles_after_warmup"] = llm.llm_engine.num_compilations - compiled
    return out


def run_transformers(args: argparse.Namespace, inputs: dict[int, list[list[int]]]) -> dict:
    import torch
    from transformers import AutoModel

    from xlm.models.builtin import resolve_model_name
    from xlm.models.loader.gguf import gguf_to_safetensors

    torch.set_num_threads(os.cpu_count() or 1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        gguf_to_safetensors(resolve_model_name("smollm2-135m"), tmp)
        model = AutoModel.from_pretrained(tmp, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    out = {"load_s": load_s, "runs": {}, "vectors": {}}

    def embed(prompts: list[list[int]]) -> list[list[float]]:
        vectors = []
        for i in range(0, len(prompts), args.hf_batch):
            ids = torch.tensor(prompts[i : i + args.hf_batch])  # one length: no padding
            with torch.inference_mode():
                hidden = model(input_ids=ids).last_hidden_state[:, -1]
            vectors.extend(torch.nn.functional.normalize(hidden, dim=-1).tolist())
        return vectors

    for length, prompts in inputs.items():
        embed(prompts[:4])  # warm
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            vectors = embed(prompts)
            times.append(time.perf_counter() - t0)
        out["runs"][length] = times
        out["vectors"][length] = vectors[:8]
    return out


def worker(args: argparse.Namespace) -> None:
    from xlm.tokenizer import get_tokenizer

    tokenizer = get_tokenizer("smollm2-135m")
    inputs = {n: make_inputs(tokenizer, n, args.inputs) for n in args.lengths}
    run = run_xlm if args.worker == "xlm" else run_transformers
    print("RESULT " + json.dumps(run(args, inputs)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16,64,256")
    parser.add_argument("--inputs", type=int, default=128, help="inputs per call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-tokens", type=int, default=2048, help="xlm's step budget")
    parser.add_argument("--hf-batch", type=int, default=32, help="transformers' batch size")
    parser.add_argument("--engines", default="xlm,transformers")
    parser.add_argument("--out", default=os.path.join(HERE, "embed.json"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.lengths = [int(n) for n in str(args.lengths).split(",")]
    if args.worker:
        worker(args)
        return

    load = os.getloadavg()[0]
    results = {}
    for engine in args.engines.split(","):
        cmd = [sys.executable, __file__, "--worker", engine, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{engine} failed:\n{proc.stderr[-4000:]}")
        results[engine] = json.loads(line[len("RESULT ") :])

    rows = []
    print(f"load average before: {load:.2f}; {args.inputs} inputs per call, float32, CPU")
    print("| engine | input tokens | inputs/s | tokens/s | load s |")
    print("|---|---|---|---|---|")
    for engine, res in results.items():
        for length in args.lengths:
            median = statistics.median(res["runs"][str(length)])
            row = {
                "engine": engine,
                "length": length,
                "inputs_per_s": args.inputs / median,
                "tokens_per_s": args.inputs * length / median,
                "load_s": res["load_s"],
            }
            rows.append(row)
            print(
                f"| {engine} | {length} | {row['inputs_per_s']:.1f} | "
                f"{row['tokens_per_s']:.0f} | {res['load_s']:.1f} |"
            )
    agreement = {}
    if {"xlm", "transformers"} <= set(results):
        import numpy as np

        for length in args.lengths:
            a = np.asarray(results["xlm"]["vectors"][str(length)])
            b = np.asarray(results["transformers"]["vectors"][str(length)])
            agreement[length] = float((a * b).sum(-1).min())  # both unit vectors
        print("lowest cosine xlm vs transformers per length:", agreement)
    if "xlm" in results:
        print("xlm compilations after warm-up:", results["xlm"]["compiles_after_warmup"])
    with open(args.out, "w") as f:
        json.dump(
            {"load_average": load, "args": vars(args), "rows": rows, "cosine_min": agreement},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
