"""One environment variable's values side by side: an engine per run, turns alternating.

    python benchmarks/env_ab.py --var XLM_CPU_SPIN_US --values 0,default \
        [--quantization w8a8] [--dtype bfloat16] [--turns 2] [--out FILE]

Each run is a fresh process (one `xlm.LLM` on the built-in SmolLM2, the given
quantization and dtype) that waits for all its programs (a shared XLM_COMPILATION_CACHE_DIR under
/tmp makes later runs load them), then decodes one request of 128 greedy tokens five times
(the decode rate of each) and a batch of 64 requests x 64 tokens twice (after one
warm-up). The runs alternate value by value, `--turns` times; "default" leaves the variable
unset. Prints one JSON line per run and writes them all to --out. Compare medians of the
later repeats: the first one-request repeats of a process run slower here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import settle  # noqa: E402

sys.path.pop(0)

RUN = r"""
import json, os, sys, time
import xlm
quantization = sys.argv[1] or None
llm = xlm.LLM(
    model="smollm2-135m", quantization=quantization, dtype=sys.argv[3], max_model_len=512
)
llm.wait_for_programs()
time.sleep(3)
prompt = "The history of the printing press begins in the fifteenth century, when"
one = xlm.SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
llm.generate([prompt], one, use_tqdm=False)
rates = []
for _ in range(5):
    start = time.perf_counter()
    out = llm.generate([prompt], one, use_tqdm=False)
    rates.append(round(len(out[0].outputs[0].token_ids) / (time.perf_counter() - start), 1))
words = open(sys.argv[2]).read().split()
batch = [" ".join(words[i * 7 : i * 7 + 10 + (i % 5) * 6]) for i in range(64)]
sixty_four = xlm.SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
llm.generate(batch, sixty_four, use_tqdm=False)
batch_rates = []
for _ in range(2):
    start = time.perf_counter()
    outs = llm.generate(batch, sixty_four, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    batch_rates.append(round(tokens / (time.perf_counter() - start), 1))
print("RESULT", json.dumps({"one_request": rates, "batch_64": batch_rates}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--var", required=True)
    parser.add_argument("--values", required=True, help="comma-separated; 'default': unset")
    parser.add_argument("--quantization", default="")
    parser.add_argument("--dtype", default="auto", help="xlm.LLM's dtype (bfloat16: half weights)")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    text = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
    env = dict(os.environ)
    env.setdefault("XLM_COMPILATION_CACHE_DIR", f"/tmp/xlm-env-ab-{os.getpid()}")
    rows = []
    for turn in range(args.turns):
        for value in args.values.split(","):
            run_env = {k: v for k, v in env.items() if k != args.var}
            if value != "default":
                run_env[args.var] = value
            load = settle(1.5, 300)  # the last run's own load, gone
            proc = subprocess.run(
                [sys.executable, "-c", RUN, args.quantization, text, args.dtype],
                env=run_env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"run failed ({args.var}={value}):\n{proc.stderr[-3000:]}")
            row = {"turn": turn, args.var: value, "load_before": load}
            row.update(json.loads(lines[-1].removeprefix("RESULT ")))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        record = {
            "command": "python benchmarks/env_ab.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "runs": rows,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
