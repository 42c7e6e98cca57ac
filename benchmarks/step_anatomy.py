"""What a decode step's model program is made of, on the built-in model (issue 26 groundwork).

    python benchmarks/step_anatomy.py [--batches 1,64] [--out benchmarks/step_anatomy.json]

Two views, each ablation in its own process (no program cache, so every variant compiles
its own programs):
- **HLO**: the optimized XLA:CPU program of the 1-token and 64-token model buckets, its
  instructions counted by kind (fusions, copies, transposes, dots, gathers, while loops):
  on CPU every one is a thunk with its own dispatch cost, whatever its size.
- **Ablations**: the model program's time per decode step (blocked on its result, async
  scheduling off, min over 3 passes of 32 greedy tokens on real-text prompts of 16-64
  tokens) with one piece of the layer replaced by a no-op: attention and the KV write,
  attention alone (the KV write kept), the RMSNorms, the rotary embedding. The outputs of
  an ablated engine are garbage; only its time is read. The difference to the full program
  is that piece's cost, within the machine's run-to-run noise (a few %: the full
  program runs first and last, both reported).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

ABLATIONS = ("full", "no_attention_no_kv_write", "no_attention", "no_rmsnorm", "no_rope", "full")
ENGINE = dict(
    model="smollm2-135m",
    max_model_len=1024,
    startup_programs="all",
    enable_compilation_cache=False,
    async_scheduling=False,
)


def ablate(mode: str) -> None:
    """Replace one piece of the layer by a no-op in this process (before any tracing)."""
    import xlm.ops.layernorm as layernorm
    import xlm.ops.paged_attention as attention
    import xlm.ops.rotary_embedding as rotary

    if mode in ("no_attention", "no_attention_no_kv_write"):
        attention.ragged_paged_attention = lambda q, kv_cache, metadata, **kw: q
    if mode == "no_attention_no_kv_write":
        attention.write_kv = lambda kv_cache, k, v, slot_mapping: kv_cache
    if mode == "no_rmsnorm":

        def no_norm(self, x, residual=None):
            return x if residual is None else (x + residual, x + residual)

        layernorm.RMSNorm.forward_native = no_norm
    if mode == "no_rope":
        rotary.RotaryEmbedding.forward_native = lambda self, positions, q, k: (q, k)


def hlo_counts(text: str) -> dict[str, int]:
    kinds = ("fusion", "copy", "transpose", "dot", "gather", "scatter", "while", "custom-call")
    counts = {k: len(re.findall(rf"\b{k}\(", text)) for k in kinds}
    counts["instructions"] = len(re.findall(r"^\s+\S+ = ", text, re.M))
    return counts


def run_one(mode: str, batches: list[int]) -> dict:
    ablate(mode)
    import xlm
    from benchmarks.profile_step import StepTimer, real_prompts

    llm = xlm.LLM(max_num_seqs=max(batches), **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    out: dict = {"mode": mode}
    if mode == "full":
        for key, spec in runner.program_specs().items():
            if key.kind.value == "model" and key.size in (1, 64):
                out[f"hlo_model[{key.size}]"] = hlo_counts(spec.lower().compile().as_text())
    timer = StepTimer()
    timer.install(runner)
    params = xlm.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for batch in batches:
        prompts = [{"prompt_token_ids": p} for p in real_prompts(llm.get_tokenizer(), batch)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        passes = []
        for _ in range(3):
            timer.seconds.clear()
            timer.calls.clear()
            llm.generate(prompts, params, use_tqdm=False)
            passes.append(timer.seconds["model program"] / timer.calls["model program"] * 1e3)
        out[f"model_ms_batch{batch}"] = min(passes)
        out[f"model_ms_batch{batch}_passes"] = passes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--out", default=str(HERE / "step_anatomy.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        print(json.dumps(run_one(args.one, batches)))
        return
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": os.getloadavg(),
        "runs": [],
    }
    env = dict(os.environ, XLM_DISABLE_PROGRESS_BARS="1", XLM_LOGGING_LEVEL="WARNING")
    for mode in ABLATIONS:
        cmd = [sys.executable, __file__, "--one", mode, "--batches", args.batches]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        report["runs"].append(result)
        times = "  ".join(f"batch {b}: {result[f'model_ms_batch{b}']:.1f} ms" for b in batches)
        print(f"{mode:26s} {times}", flush=True)
        for key in ("hlo_model[1]", "hlo_model[64]"):
            if key in result:
                print(f"  {key}: {result[key]}", flush=True)
    report["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
