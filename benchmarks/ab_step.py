"""Old vs new source tree on the same machine: greedy outputs and a short offline throughput.

    PYTHONPATH=<tree> XLM_CACHE_ROOT=<dir per tree> python benchmarks/ab_step.py

Run once per tree (a `git archive` of each commit), alternating or at the same time, and
compare the printed RESULT lines: identical greedy token ids are required; tokens/s
compare only within one run on one machine. Small engine shapes (token buckets 16, 64)
keep the compile short on a busy 2-core machine.
"""

import json
import time

import numpy as np

import xlm

llm = xlm.LLM(
    model="smollm2-135m",
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[16, 64],
    startup_programs="all",  # steady state: every program before timing
)
prompts = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
    "Water boils at",
]
outs = llm.generate(prompts, xlm.SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
greedy = [[list(o.outputs[0].token_ids), o.outputs[0].text] for o in outs]
rng = np.random.default_rng(0)
bench = [
    {"prompt_token_ids": rng.integers(100, 40000, size=int(rng.integers(16, 48))).tolist()}
    for _ in range(16)
]
params = xlm.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
llm.generate(bench[:4], params, use_tqdm=False)
compiled = llm.llm_engine.num_compilations
t = time.perf_counter()
outs = llm.generate(bench, params, use_tqdm=False)
secs = time.perf_counter() - t
result = {
    "greedy": greedy,
    "bench_tokens": [list(o.outputs[0].token_ids) for o in outs],
    "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / secs,
    "secs": secs,
    "compiles_after_warmup": llm.llm_engine.num_compilations - compiled,
}
print("RESULT " + json.dumps(result))
