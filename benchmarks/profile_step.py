"""Where one step's time goes, at batch 1 and batch 64, on the built-in model.

    python benchmarks/profile_step.py [--batches 1,64] [--output-len 64] [--quantization Q]
        [--out FILE]

Runs `LLM.generate` on real-text prompts (benchmarks/peers_prompts.txt, 16-64 tokens,
greedy, EOS ignored) and splits the wall time of the decode steps into:
- model program: the forward (blocked on its result), and within it the dense matmuls
  (q/k/v/o, gate/up/down, lm_head) timed alone on the same weights at the same batch, so
  "rest of the model" = attention, KV writes, norms, rope, embedding;
- sampler program;
- host, in the runner: building the step's inputs from the persistent batch, packing and
  the transfer, fetching the sampled tokens;
- host, outside the runner: scheduler, output processing and detokenization.
It also reports the matmuls' GFLOP/s against the peak of a large f32 matmul measured in
the same run. The program timings block on each program's result, so the profile runs
the engine with async scheduling off: host and device take turns and the parts add up
(with it on, the host parts overlap the device's).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def real_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 16-64 tokens from the real-text passages peers.py uses."""
    spec = importlib.util.spec_from_file_location("benchmarks_peers", HERE / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    return peers.load_prompts(tokenizer, n, seed)


class StepTimer:
    """Wraps the runner's programs and input building to time them (blocking)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.decode_only = True

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1

    def install(self, runner) -> None:
        import jax

        from xlm.worker import model_runner as mr

        compiler_get = runner.program_store.get

        def get(key, spec, static=None):
            program = compiler_get(key, spec, static)
            return self.wrap(
                f"{key.kind.value} program", lambda *a: jax.block_until_ready(program(*a))
            )

        runner.program_store.get = get
        runner._prepare_inputs = self.wrap("host: build inputs", runner._prepare_inputs)
        mr.to_host = self.wrap("host: fetch tokens", mr.to_host)
        runner.execute_model = self.wrap("runner total", runner.execute_model)

    def wrap(self, name: str, fn):
        """fn, timed into `name` on every call."""

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.add(name, time.perf_counter() - start)
            return out

        return timed


def matmul_time(state, batch: int, repeats: int = 10) -> tuple[float, float]:
    """(seconds, FLOPs) of every 2-D weight's matmul at this batch, alone, on the same
    weights (the embedding counted once, as the tied lm_head)."""
    import jax
    import jax.numpy as jnp

    weights = [x for x in jax.tree_util.tree_leaves(state) if getattr(x, "ndim", 0) == 2]

    def all_matmuls(ws):
        total = jnp.zeros((), jnp.float32)
        for w in ws:
            if w.shape[0] > w.shape[1] * 8:  # the [vocab, hidden] embedding: x @ w.T
                y = jnp.ones((batch, w.shape[1]), w.dtype) @ w.T
            else:
                y = jnp.ones((batch, w.shape[0]), w.dtype) @ w
            total += y[0, 0]
        return total

    flops = sum(2 * batch * w.shape[0] * w.shape[1] for w in weights)
    fn = jax.jit(all_matmuls).lower(weights).compile()
    fn(weights).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(weights).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best, flops


def peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = min(
        (lambda s: (f(a).block_until_ready(), time.perf_counter() - s)[1])(time.perf_counter())
        for _ in range(repeats)
    )
    return 2 * n**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quantization", default=None, help="e.g. w8a8 (default: float)")
    parser.add_argument("--out", default=str(HERE / "profile_step.json"))
    args = parser.parse_args()
    os.environ.setdefault("XLM_DISABLE_PROGRESS_BARS", "1")
    import xlm

    batches = [int(b) for b in args.batches.split(",")]
    llm = xlm.LLM(
        model=args.model,
        max_num_seqs=max(batches),
        enable_prefix_caching=False,
        async_scheduling=False,
        startup_programs="all",  # steady state: every program before timing
        quantization=args.quantization,
    )
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    timer = StepTimer()
    timer.install(runner)
    prompts = real_prompts(llm.get_tokenizer(), max(batches))
    params = xlm.SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    results: dict[str, object] = {
        "load_before": os.getloadavg(),
        "peak_gflops": peak_gflops(),
        "args": vars(args),
    }
    for batch in batches:
        batch_prompts = [{"prompt_token_ids": p} for p in prompts[:batch]]
        llm.generate(batch_prompts, params, use_tqdm=False)  # warm
        # Decode steps only: the whole run minus a 1-token run (the prefill and the first
        # sample), part by part.
        parts = []
        for max_tokens in (1, args.output_len):
            timer.seconds.clear()
            timer.calls.clear()
            p = xlm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(batch_prompts, p, use_tqdm=False)
            wall = time.perf_counter() - start
            parts.append((wall, dict(timer.seconds), dict(timer.calls)))
        (wall1, sec1, calls1), (wall, sec, calls) = parts
        steps = calls["runner total"] - calls1["runner total"]
        per_step = {k: 1e3 * (sec[k] - sec1.get(k, 0.0)) / steps for k in sec}
        wall_step = 1e3 * (wall - wall1) / steps
        # The dense matmuls alone are timed for float weights (a quantized model's
        # kernels are its scheme's op, not a float dot): left out under --quantization.
        mm_s, mm_flops = (None, None) if args.quantization else matmul_time(runner.state, batch)
        row = {
            "decode_steps": steps,
            "step_ms": wall_step,
            "model_program_ms": per_step.get("model program", 0.0),
            "matmuls_alone_ms": None if mm_s is None else 1e3 * mm_s,
            "sampler_program_ms": per_step.get("sampler program", 0.0),
            "host_build_inputs_ms": per_step.get("host: build inputs", 0.0),
            "host_fetch_ms": per_step.get("host: fetch tokens", 0.0),
            "runner_total_ms": per_step.get("runner total", 0.0),
            "matmul_gflops": None if mm_s is None else mm_flops / mm_s / 1e9,
            "decode_tok_s": batch * 1e3 / wall_step,
        }
        row["rest_of_model_ms"] = (
            None if mm_s is None else row["model_program_ms"] - row["matmuls_alone_ms"]
        )
        row["host_in_runner_other_ms"] = (
            row["runner_total_ms"]
            - row["model_program_ms"]
            - row["sampler_program_ms"]
            - row["host_build_inputs_ms"]
            - row["host_fetch_ms"]
        )
        row["host_outside_runner_ms"] = wall_step - row["runner_total_ms"]
        results[f"batch_{batch}"] = row
    results["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"peak f32 matmul: {results['peak_gflops']:.0f} GFLOP/s; load {results['load_before']}")
    names = [
        k
        for k, v in results[f"batch_{batches[0]}"].items()
        if k != "decode_steps" and v is not None
    ]
    print("| per decode step | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name in names:
        cells = " | ".join(f"{results[f'batch_{b}'][name]:.1f}" for b in batches)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
