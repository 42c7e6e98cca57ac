"""Where a decode step's time goes inside XLA:CPU's programs, thunk by thunk.

    python benchmarks/profile_thunks.py [--batch 64] [--steps 16] [--quantization w8a8]
        [--out FILE]

Runs the built-in model on `--batch` real-text prompts (benchmarks/peers_prompts.txt,
16-64 tokens, greedy, EOS ignored): the prompts' prefill and a few decode steps first,
then `--steps` decode steps under `jax.profiler`. XLA:CPU's thunk executor records one
event per thunk (a fusion, a dot, a custom call, a conditional); each is matched to its
instruction in the compiled HLO of the step's model and sampler programs and summed by
what it computes (the `op_name` jax gave it: dot_general, concatenate, the attention
call, ...). Times are thunk time summed over XLA's threads per step; a conditional's
time includes the thunks inside it, which are also listed on their own. Async
scheduling is off, so the host and the device take turns.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Events of the runtime around the thunks, not thunks.
_RUNTIME = ("ThunkExecutor", "SlinkyThreadPool", "$", "PjitFunction", "Parse", "Common")
_WRAPPERS = ("jit(", "cond", "branch", "while", "body", "remat", "checkpoint", "pjit")


def hlo_instructions(hlo: str) -> dict[str, tuple[str, str, str]]:
    """Instruction name -> (opcode, shape, what it computes from its op_name)."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) (\w[\w\-]*)\(", line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        parts = (op.group(1) if op else "").split("/")
        what = "/".join(p for p in parts if p and not p.startswith(_WRAPPERS))
        if m.group(3) == "custom-call" or "ffi_call" in line:
            target = re.search(r'custom_call_target="([^"]*)"', line)
            what = target.group(1) if target else what
        out[m.group(1)] = (m.group(3), m.group(2).split("{")[0], what[-60:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quantization", default=None, help="e.g. w8a8 (default: float)")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args()

    import jax
    from jax._src.lib import _profile_data
    from profile_step import real_prompts

    import xlm
    from xlm.worker.compilation import ProgramKind

    load_before = os.getloadavg()
    llm = xlm.LLM(
        model=args.model,
        max_num_seqs=max(args.batch, 1),
        startup_programs="all",
        enable_prefix_caching=False,
        async_scheduling=False,
        quantization=args.quantization,
    )
    engine = llm.llm_engine
    runner = engine.engine_core.engine_core.executor.worker.model_runner
    prompts = real_prompts(llm.get_tokenizer(), args.batch)
    params = xlm.SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    for _ in range(4):  # the prefill and a few decode steps, untimed
        engine.step()
    bucket = runner.buckets.token_bucket(args.batch)
    rows = runner.buckets.sampler_bucket(runner.buckets.logit_rows_for_tokens(bucket))
    names: dict[str, tuple[str, str, str]] = {}
    for kind, size in ((ProgramKind.SAMPLER, rows), (ProgramKind.MODEL, bucket)):
        _, program = runner.program_store._programs[runner._key(kind, size)]
        names.update(hlo_instructions(program.as_text()))

    trace_dir = tempfile.mkdtemp(prefix="xlm-thunks-")
    try:
        start = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for _ in range(args.steps):
                engine.step()
        wall = (time.perf_counter() - start) / args.steps
        path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        data = _profile_data.ProfileData.from_file(path)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)

    per_thunk: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                if not event.name.startswith(_RUNTIME):
                    per_thunk[event.name] += event.duration_ns
    by_what: collections.Counter[str] = collections.Counter()
    for name, ns in per_thunk.items():
        opcode, _, what = names.get(name, ("?", "", name))
        by_what[f"{opcode} {what}"] += ns
    ms = {k: v / 1e6 / args.steps for k, v in by_what.most_common()}
    top = {
        name: {"ms": ns / 1e6 / args.steps, "hlo": names.get(name)}
        for name, ns in per_thunk.most_common(15)
    }
    print(f"batch {args.batch}, token bucket {bucket}: {1e3 * wall:.1f} ms per step (wall, traced)")
    print("ms per step, summed over XLA's threads, by what the thunk computes:")
    for k, v in ms.items():
        if v >= 0.05:
            print(f"  {v:8.2f}  {k}")
    print("largest thunks:")
    for name, row in top.items():
        print(f"  {row['ms']:8.2f}  {name}  {row['hlo']}")
    if args.out:
        load_after = os.getloadavg()
        Path(args.out).write_text(
            json.dumps(
                {
                    "command": "benchmarks/profile_thunks.py "
                    + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "load_before": load_before,
                    "load_after": load_after,
                    "wall_ms_per_step": 1e3 * wall,
                    "ms_per_step_by_what": ms,
                    "largest_thunks": top,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
