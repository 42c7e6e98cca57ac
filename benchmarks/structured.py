"""Structured outputs: host cost per step, grammar compile time, constrained vs free throughput.

    python benchmarks/structured.py [--model smollm2-135m] [--num-prompts 16] [--output-len 64]
    python benchmarks/structured.py --skip-engine      # host-side parts only (no engine)

1. Host cost of one step for B constrained requests (B = 1, 16, 64): fill the step's
   int32 bitmask for all B (``StructuredOutputManager.grammar_bitmask``) and advance
   every matcher by one sampled token (``advance``), on the real tokenizer.
2. Grammar compile time per JSON schema: cold (cache cleared) and cached (a copy of the
   compiled template).
3. Offline throughput of the same W requests all JSON-constrained vs all free, in one run
   with the two alternating (output tokens/s, and the ratio).

Prints tables and writes benchmarks/structured.json (with `uptime` load: on a shared
machine absolute times drift, the ratios are what counts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "first": {"type": "string"},
                    "last": {"type": "string"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                },
                "required": ["first", "last"],
            },
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["person", "score"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "item": {"type": "string"},
                "qty": {"type": "integer", "minimum": 1},
                "unit": {"enum": ["kg", "g", "l", "ml", "piece"]},
            },
            "required": ["item", "qty", "unit"],
        },
        "maxItems": 10,
    },
    "wide_anyof": {
        "anyOf": [
            {
                "type": "object",
                "properties": {f"field_{k}_{i}": {"type": "string"} for i in range(8)},
                "required": [f"field_{k}_0"],
            }
            for k in range(6)
        ]
    },
}


def load() -> str:
    return os.popen("uptime").read().strip()


def make_manager(tokenizer, vocab_size):
    from xlm.structured_output.manager import StructuredOutputManager

    return StructuredOutputManager(lambda: tokenizer, vocab_size, [tokenizer.eos_token_id])


def host_cost(tokenizer, vocab_size: int, batches: list[int], steps: int) -> list[dict]:
    """Per-step host time of bitmask fill + matcher advance at each batch size."""
    from xlm import StructuredOutputsParams

    manager = make_manager(tokenizer, vocab_size)
    params = StructuredOutputsParams(json=SCHEMAS["nested"])
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        requests = [manager.init_request(params, [1]) for _ in range(batch)]
        for r in requests:
            r.future.result()
            r.is_ready()
        fill_times, advance_times = [], []
        for _ in range(steps):
            t = time.perf_counter()
            bitmask = manager.grammar_bitmask(requests)
            t_fill = time.perf_counter() - t
            # Pick an allowed token per row (a stand-in for the sampler; not timed).
            bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
            tokens = [int(rng.choice(np.flatnonzero(bits[i, :vocab_size]))) for i in range(batch)]
            t = time.perf_counter()
            verdicts = [manager.advance(r, [tok]) for r, tok in zip(requests, tokens)]
            t_adv = time.perf_counter() - t
            fill_times.append(t_fill)
            advance_times.append(t_adv)
            for i, verdict in enumerate(verdicts):
                if verdict is not None:  # finished: start that row over
                    requests[i] = manager.init_request(params, [1])
                    requests[i].future.result()
                    requests[i].is_ready()
        fill = statistics.median(fill_times) * 1e3
        adv = statistics.median(advance_times) * 1e3
        rows.append(
            {
                "batch": batch,
                "bitmask_ms": round(fill, 3),
                "advance_ms": round(adv, 3),
                "total_ms": round(fill + adv, 3),
                "per_request_us": round((fill + adv) * 1e3 / batch, 1),
            }
        )
    manager.shutdown()
    return rows


def compile_times(tokenizer, vocab_size: int, repeats: int) -> list[dict]:
    """Cold and cached compile time of each schema (median of `repeats`)."""
    from xlm import StructuredOutputsParams

    manager = make_manager(tokenizer, vocab_size)
    compiler = manager.compiler  # builds llguidance's tokenizer once (not counted)
    rows = []
    for name, schema in SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        cold, cached = [], []
        for _ in range(repeats):
            compiler.clear()
            t = time.perf_counter()
            compiler.matcher(params)
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            compiler.matcher(params)
            cached.append(time.perf_counter() - t)
        rows.append(
            {
                "schema": name,
                "cold_ms": round(statistics.median(cold) * 1e3, 2),
                "cached_ms": round(statistics.median(cached) * 1e3, 3),
            }
        )
    manager.shutdown()
    return rows


def throughput(model: str, num_prompts: int, output_len: int, rounds: int, **engine) -> dict:
    """All-constrained vs all-free output tokens/s on the same prompts, alternating."""
    import xlm
    from xlm import SamplingParams, StructuredOutputsParams

    llm = xlm.LLM(model=model, startup_programs="all", **engine)
    prompts = [f"Person {i} as JSON:" for i in range(num_prompts)]
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "bio": {"type": "string"},
            "hobbies": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "bio", "hobbies"],
    }
    # The constrained run finishes early when a JSON value completes; the free run gets
    # the same token counts per request (ignore_eos, max_tokens = what the constrained
    # run produced), so both runs generate the same number of tokens.
    constrained = SamplingParams(
        temperature=0,
        max_tokens=output_len,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    llm.generate(prompts[:2], constrained, use_tqdm=False)  # grammar compiled, tokenizer built
    results: dict[str, list[float]] = {"constrained": [], "free": []}
    counts = None
    for _ in range(rounds):
        t = time.perf_counter()
        outs = llm.generate(prompts, constrained, use_tqdm=False)
        elapsed = time.perf_counter() - t
        counts = [len(o.outputs[0].token_ids) for o in outs]
        results["constrained"].append(sum(counts) / elapsed)
        free = [SamplingParams(temperature=0, max_tokens=c, ignore_eos=True) for c in counts]
        t = time.perf_counter()
        outs = llm.generate(prompts, free, use_tqdm=False)
        elapsed = time.perf_counter() - t
        results["free"].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    c, f = max(results["constrained"]), max(results["free"])
    return {
        "num_prompts": num_prompts,
        "output_tokens": sum(counts or []),
        "constrained_tok_s": round(c, 1),
        "free_tok_s": round(f, 1),
        "constrained_over_free": round(c / f, 3),
        "rounds": {k: [round(x, 1) for x in v] for k, v in results.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50, help="host-cost steps per batch size")
    parser.add_argument("--skip-engine", action="store_true", help="host-side parts only")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (16 tokens)")
    parser.add_argument("--output", default=str(HERE / "structured.json"))
    args = parser.parse_args()

    from xlm.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(args.model)
    vocab_size = len(tokenizer)
    report: dict = {"model": args.model, "load_before": load()}

    report["host_cost"] = host_cost(tokenizer, vocab_size, [1, 16, 64], args.steps)
    print("\nHost cost per step (bitmask fill + matcher advance), nested JSON schema")
    print(f"{'batch':>6} {'bitmask ms':>11} {'advance ms':>11} {'total ms':>9} {'us/request':>11}")
    for r in report["host_cost"]:
        print(
            f"{r['batch']:>6} {r['bitmask_ms']:>11.3f} {r['advance_ms']:>11.3f} "
            f"{r['total_ms']:>9.3f} {r['per_request_us']:>11.1f}"
        )

    report["compile"] = compile_times(tokenizer, vocab_size, repeats=5)
    print("\nGrammar compile time per schema")
    print(f"{'schema':>18} {'cold ms':>9} {'cached ms':>10}")
    for r in report["compile"]:
        print(f"{r['schema']:>18} {r['cold_ms']:>9.2f} {r['cached_ms']:>10.3f}")

    if not args.skip_engine:
        # The test suite's small SmolLM2 shapes (their compiled programs are reusable).
        engine = dict(
            max_model_len=args.max_model_len,
            block_size=16,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=64,
            token_buckets=[16, 64],
            num_gpu_blocks_override=args.num_blocks,
        )
        report["throughput"] = tp = throughput(
            args.model, args.num_prompts, args.output_len, args.rounds, **engine
        )
        report["engine"] = engine
        print(f"\nThroughput, {tp['num_prompts']} requests, {tp['output_tokens']} output tokens")
        print(f"  all JSON-constrained: {tp['constrained_tok_s']:.1f} tok/s")
        print(f"  all free:             {tp['free_tok_s']:.1f} tok/s")
        print(f"  constrained / free:   {tp['constrained_over_free']:.3f}")
    report["load_after"] = load()
    print(f"\nload: {report['load_before']}  ->  {report['load_after']}")
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
