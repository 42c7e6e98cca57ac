"""The sampler program alone: XLA compile time (CPU seconds of this process, all threads)
and run time per call, at a vocabulary and row counts the engine uses.

`xlm.worker.sampler.sample` jitted with every feature switch a device boolean, as the
engine's sampler program is (the engine's also unpacks its packed inputs first). Cases:
greedy rows; random rows (temperature 0.8); random rows with top-k 50 and top-p 0.9;
random rows with a speculative proposal to accept or reject. Compare two trees by running
this under each (PYTHONPATH=<tree>) on a quiet machine:

    PYTHONPATH=<tree> python benchmarks/sampler_program.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlm.worker import sampler as sampler_lib

CASES = ("greedy", "random", "top_k_top_p", "speculative")


def metadata(rows: int, vocab: int, max_len: int, case: str) -> sampler_lib.SamplingMetadata:
    """Host arrays for `rows` requests of one case (seeded, 100 tokens generated each)."""
    greedy = case == "greedy"
    f = lambda value: np.full(rows, value, np.float32)  # noqa: E731
    no_ids = np.full((rows, max_len), vocab, np.int32)
    return sampler_lib.SamplingMetadata(
        temperature=f(1.0 if greedy else 0.8),
        is_greedy=np.full(rows, greedy),
        top_k=np.full(rows, 50 if case == "top_k_top_p" else vocab, np.int32),
        top_p=f(0.9 if case == "top_k_top_p" else 1.0),
        min_p=f(0.0),
        seeds=np.stack([np.arange(rows), np.zeros(rows)], -1).astype(np.uint32),
        has_seed=np.ones(rows, bool),
        output_lens=np.full(rows, 100, np.int32),
        presence_penalty=f(0.0),
        frequency_penalty=f(0.0),
        repetition_penalty=f(1.0),
        output_token_ids=no_ids,
        prompt_token_ids=no_ids,
        logit_bias_ids=np.full((rows, 64), vocab, np.int32),
        logit_bias_values=np.zeros((rows, 64), np.float32),
        token_mask=np.full((rows, -(-vocab // 8)), 255, np.uint8),
        grammar_bitmask=np.full((rows, -(-vocab // 32)), -1, np.int32),
        step_seed=np.array([7, 0], np.uint32),
        draft_token_ids=np.full(rows, 3 if case == "speculative" else -1, np.int32),
        all_greedy=np.array(greedy),
        any_filters=np.array(case == "top_k_top_p"),
        any_penalties=np.array(False),
        any_logit_bias=np.array(False),
        any_mask=np.array(False),
        any_grammar=np.array(False),
        any_logprobs=np.array(False),
        any_draft=np.array(case == "speculative"),
    )


def measure(rows: int, vocab: int, max_len: int, repeats: int) -> dict:
    """Compile once for `rows` (every case runs the same program), then time each case."""
    fn = jax.jit(sampler_lib.sample, static_argnames=("config",))
    config = sampler_lib.SamplerConfig()
    logits = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32) * 4
    md = metadata(rows, vocab, max_len, "greedy")
    lowered = fn.lower(jnp.asarray(logits), jax.tree.map(jnp.asarray, md), config=config)
    cpu, wall = time.process_time(), time.perf_counter()
    program = lowered.compile()
    row = {
        "rows": rows,
        "compile_cpu_s": time.process_time() - cpu,
        "compile_wall_s": time.perf_counter() - wall,
    }
    device_logits = jnp.asarray(logits)
    for case in CASES:
        args = jax.tree.map(jnp.asarray, metadata(rows, vocab, max_len, case))
        jax.block_until_ready(program(device_logits, args))  # warm
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(program(device_logits, args))
            times.append(time.perf_counter() - t)
        row[f"{case}_ms"] = 1e3 * statistics.median(times)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64", help="row counts, comma-separated")
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = [
        measure(int(r), args.vocab, args.max_model_len, args.repeats) for r in args.rows.split(",")
    ]
    header = ["rows", "compile_cpu_s", "compile_wall_s", *(f"{c}_ms" for c in CASES)]
    print(" | ".join(header))
    for row in rows:
        print(
            " | ".join(
                f"{row[h]:.2f}" if isinstance(row[h], float) else str(row[h]) for h in header
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": args.vocab, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
