"""The first GPU run of xlm (issue 40, before device_check.sh exists): does the engine run
on the device image's jax, and do its greedy tokens equal the CPU's?

For each tiny random family: greedy tokens of three prompts on the default backend (the
GPU there), then in a subprocess with JAX_PLATFORMS=cpu; compilations after warm-up; and
one-request decode time on the GPU. Prints one JSON line per family and the versions.

    python benchmarks/gpu/first_run.py [--cpu-only] [--families llama,qwen3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPTS = [[3, 17, 5, 60, 2, 9], [11, 12, 13], [40] * 20]


def run(path: str) -> dict:
    import jax

    import xlm

    llm = xlm.LLM(model=path, max_model_len=128, max_num_seqs=8, startup_programs="all")
    params = xlm.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    compiled = llm.llm_engine.num_compilations
    start = time.perf_counter()
    one = xlm.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], one, use_tqdm=False)
    decode_s = time.perf_counter() - start
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "compilations_after_warmup": llm.llm_engine.num_compilations - compiled,
        "one_request_64_tokens_s": round(decode_s, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--path")
    parser.add_argument("--families", default="llama,qwen3")
    args = parser.parse_args()
    if args.path:  # the subprocess: one run, its JSON on the last line
        print(json.dumps(run(args.path)))
        return
    environ = dict(os.environ)  # before tests.conftest sets JAX_PLATFORMS=cpu for tests
    sys.path.insert(0, os.getcwd())
    import jax

    from tests.conftest import write_tiny_checkpoint

    print(json.dumps({"jax": jax.__version__, "python": sys.version.split()[0]}), flush=True)
    root = tempfile.mkdtemp()
    for family in args.families.split(","):
        path = write_tiny_checkpoint(family, os.path.join(root, family))
        result = {"family": family}
        for name, env in [("device", {}), ("cpu", {"JAX_PLATFORMS": "cpu"})]:
            if args.cpu_only and name == "device":
                continue
            proc = subprocess.run(
                [sys.executable, __file__, "--path", path],
                capture_output=True,
                text=True,
                timeout=600,
                env={**environ, **env},
            )
            if proc.returncode != 0:
                result[name] = {"error": proc.stderr[-3000:]}
            else:
                result[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        if "device" in result and "tokens" in result.get("device", {}):
            result["tokens_equal"] = result["device"]["tokens"] == result["cpu"].get("tokens")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
