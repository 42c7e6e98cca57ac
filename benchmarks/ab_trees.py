"""Two source trees of xlm side by side: same greedy outputs, throughput within noise.

One long-lived worker process per tree (each with `PYTHONPATH=<tree>` and its own
`XLM_CACHE_ROOT`), driven in turns from this process, so only one tree computes at a time:
per repeat, each tree runs one request of `--single-len` greedy tokens and a batch of
`--batch` requests of `--batch-len` tokens on the real-text prompts of
`peers_prompts.txt`, EOS ignored. Repeat 0 warms up and is left out of the medians.

    git archive <old commit> | tar -x -C /tmp/old
    python benchmarks/ab_trees.py --tree old=/tmp/old --tree new=. [--repeats 4]
        [--quantization w8a8] [--dtype bfloat16]

Prints a table, writes `benchmarks/ab_trees.json` (or `--out`).
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "peers_prompts.txt"


def worker(args: argparse.Namespace) -> None:
    """Build one engine, then answer each 'run' line on stdin with one JSON line."""
    import xlm

    prompts = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()]
    llm = xlm.LLM(
        model=args.model, max_model_len=512, quantization=args.quantization, dtype=args.dtype
    )
    if hasattr(llm, "wait_for_programs"):  # trees that compile in the background: all first
        llm.generate(prompts[:1], xlm.SamplingParams(max_tokens=1), use_tqdm=False)
        llm.wait_for_programs()
    single = xlm.SamplingParams(temperature=0.0, max_tokens=args.single_len, ignore_eos=True)
    batch = xlm.SamplingParams(temperature=0.0, max_tokens=args.batch_len, ignore_eos=True)
    print(json.dumps({"ready": True, "xlm": xlm.__file__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        compiles = llm.llm_engine.num_compilations
        start = time.perf_counter()
        one = llm.generate(prompts[:1], single, use_tqdm=False)
        t_single = time.perf_counter() - start
        start = time.perf_counter()
        many = llm.generate(prompts[: args.batch], batch, use_tqdm=False)
        t_batch = time.perf_counter() - start
        result = {
            "single_tok_s": args.single_len / t_single,
            "batch_tok_s": args.batch * args.batch_len / t_batch,
            "tokens": [list(o.outputs[0].token_ids) for o in one + many],
            "compiles": llm.llm_engine.num_compilations - compiles,
        }
        print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH, twice")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantization", default=None, help="int8, w8a8, ... (default: none)")
    parser.add_argument("--dtype", default="auto", help="e.g. bfloat16 (default: the model's)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-len", type=int, default=64)
    parser.add_argument("--single-len", type=int, default=128)
    parser.add_argument("--out", default=str(HERE / "ab_trees.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    trees = dict(t.split("=", 1) for t in args.tree)
    procs = {}
    for name, path in trees.items():
        env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()))
        env["XLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix=f"ab-{name}-")
        env.pop("XLM_COMPILATION_CACHE_DIR", None)
        cmd = [sys.executable, __file__, "--worker", "--model", args.model]
        cmd += [] if args.quantization is None else ["--quantization", args.quantization]
        cmd += ["--dtype", args.dtype, "--batch", str(args.batch)]
        cmd += ["--batch-len", str(args.batch_len), "--single-len", str(args.single_len)]
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready = json.loads(proc.stdout.readline())
        print(f"{name}: engine ready ({ready['xlm']})", flush=True)
        procs[name] = proc
    rows = []
    for repeat in range(args.repeats):
        for name, proc in procs.items():
            load = os.getloadavg()[0]
            proc.stdin.write("run\n")
            proc.stdin.flush()
            row = json.loads(proc.stdout.readline())
            row.update(tree=name, repeat=repeat, load_avg_before=load)
            rows.append(row)
            print(
                f"repeat {repeat} {name}: one request {row['single_tok_s']:.1f} tok/s, "
                f"batch {args.batch} {row['batch_tok_s']:.1f} tok/s, "
                f"{row['compiles']} compiles (load {load:.2f})",
                flush=True,
            )
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    names = list(procs)
    same = all(
        a["tokens"] == b["tokens"]
        for a, b in zip(*([r for r in rows if r["tree"] == n] for n in names), strict=True)
    )
    print(f"\n| tree | one request tok/s (median) | batch {args.batch} tok/s (median) |")
    print("|---|---|---|")
    summary = {}
    for name in names:
        kept = [r for r in rows if r["tree"] == name and r["repeat"] > 0] or rows
        summary[name] = {
            key: statistics.median(r[key] for r in kept if r["tree"] == name)
            for key in ("single_tok_s", "batch_tok_s")
        }
        print(
            f"| {name} | {summary[name]['single_tok_s']:.1f} | {summary[name]['batch_tok_s']:.1f} |"
        )
    print(f"greedy token ids identical across trees: {same}")
    for row in rows:
        row.pop("tokens")
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "median": summary, "identical": same}, f, indent=1)


if __name__ == "__main__":
    main()
