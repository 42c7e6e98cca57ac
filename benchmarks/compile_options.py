"""Compile time against step time per token bucket under XLA:CPU options (issue 24).

Each option set runs in its own process (XLA reads XLA_FLAGS once): the engine's own
programs for the built-in model are compiled one at a time (no program cache), each
timed, then the model program of each bucket is run on the engine's weights and KV cache
(median of 5 runs after one warm-up; padded inputs of that bucket).

    python benchmarks/compile_options.py                      # default + the options below
    python benchmarks/compile_options.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPTIONS = {
    "default": "",
    "opt-level-1": "--xla_backend_optimization_level=1",
    "no-expensive-llvm-passes": "--xla_llvm_disable_expensive_passes=true",
    "opt-level-1+no-expensive": "--xla_backend_optimization_level=1 "
    "--xla_llvm_disable_expensive_passes=true",
    "no-thunk-runtime": "--xla_cpu_use_thunk_runtime=false",
}


def worker(model: str) -> None:
    import jax

    import xlm
    from xlm.worker.compilation import ProgramKind
    from xlm.worker.packing import pack

    llm = xlm.LLM(model=model, startup_programs="used", enable_compilation_cache=False)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    rows = []
    for key, spec in runner.program_specs().items():
        start = time.perf_counter()
        program = spec.lower().compile()
        compile_s = time.perf_counter() - start
        row = {"program": f"{key.kind.value}[{key.size}]", "compile_s": round(compile_s, 2)}
        if key.kind == ProgramKind.MODEL:
            inputs = runner._prepare_inputs([], [], key.size).arrays
            packed, _ = pack(inputs)
            args = [runner.state, runner.kv_caches, runner._put(packed), runner._prev_sampled]
            times = []
            for _ in range(6):
                start = time.perf_counter()
                args[1], logits, _ = program(*args)
                jax.block_until_ready(logits)
                times.append(time.perf_counter() - start)
            runner.kv_caches = args[1]  # donated: the next program takes the new ones
            row["step_ms"] = round(1e3 * statistics.median(times[1:]), 2)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--only", default="")
    parser.add_argument("--json", default=str(HERE / "compile_options.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.model)
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_before": load, "options": {}}
    for name, flags in OPTIONS.items():
        if args.only and name not in args.only.split(","):
            continue
        env = dict(os.environ, XLA_FLAGS=flags, XLM_DISABLE_PROGRESS_BARS="1")
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", "--model", args.model],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
        rows = json.loads(line[len("RESULT ") :])
        results["options"][name] = {"xla_flags": flags, "programs": rows}
        total = sum(r["compile_s"] for r in rows)
        print(f"{name}: {total:.1f} s of compile for {len(rows)} programs", flush=True)
        for r in rows:
            print(f"  {r['program']:22} {r['compile_s']:6.2f} s  {r.get('step_ms', '')}")
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
