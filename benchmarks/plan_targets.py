"""`xlm plan` on the published shapes of Llama-3.1-8B and 70B (config.json only, in
benchmarks/configs) for TPU slices: the cases docs/tpu.md and RESULTS.md quote.

Each plan runs in its own process (a cold start: nothing compiled before), one after the
other; the full text output of each goes to stdout and its JSON to benchmarks/plan/.
Compile times are wall-clock on this machine; speed figures are roofline estimates.

    python benchmarks/plan_targets.py [--all] [--only 8b-v5e-2x2,...]

GPU cases need JAX's CUDA plugin; a separate environment keeps its 5.5 GB out of the
test setup:

    python -m venv --system-site-packages .venv-cuda
    .venv-cuda/bin/pip install "jax[cuda12]==0.10.2"
    JAX_PLATFORMS=cpu .venv-cuda/bin/python benchmarks/plan_targets.py --only 70b-h100-8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

from xlm.entrypoints.plan import format_report

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "configs")

# (name, model, topology, tp, extra engine flags, expected exit code)
CASES = [
    ("8b-v5e-2x2", "Llama-3.1-8B", "v5e:2x2", 4, ["--max-model-len", "8192"], 0),
    ("8b-v6e-2x2", "Llama-3.1-8B", "v6e:2x2", 4, ["--max-model-len", "8192"], 0),
    ("70b-v5e-4x4", "Llama-3.1-70B", "v5e:4x4", 16, ["--max-model-len", "8192"], 0),
    ("70b-v5e-2x2", "Llama-3.1-70B", "v5e:2x2", 4, ["--max-model-len", "8192"], 1),
    # Needs JAX's CUDA plugin (jax[cuda12]); skipped without it.
    ("70b-h100-8", "Llama-3.1-70B", "h100:8", 8, ["--max-model-len", "8192"], 0),
]


def run(case: tuple, every: bool) -> dict:
    name, model, topology, tp, extra, expected = case
    cmd = [
        sys.executable,
        "-m",
        "xlm.entrypoints.cli",
        "plan",
        os.path.join(CONFIGS, model),
        "--target-topology",
        topology,
        "-tp",
        str(tp),
        *extra,
    ]
    if every:
        cmd.append("--all")
    # No out-of-tree plugins: the programs are xlm's own.
    env = {**os.environ, "XLM_PLUGINS": "", "XLM_DISABLE_PROGRESS_BARS": "1"}
    start = time.perf_counter()
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    shown = " ".join(["xlm", *cmd[3:]]).replace(HERE + "/", "benchmarks/")
    print(f"$ {shown}    # exit {out.returncode}, {seconds:.0f} s wall")
    if out.returncode != expected:
        raise SystemExit(f"{name}: exit {out.returncode}, expected {expected}:\n{out.stderr}")
    report = json.loads(out.stdout)
    print(format_report(report))
    if out.returncode != 0:
        print(out.stderr.strip().splitlines()[-1])
    print()
    os.makedirs(os.path.join(HERE, "plan"), exist_ok=True)
    with open(os.path.join(HERE, "plan", f"{name}{'-all' if every else ''}.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--all", dest="every", action="store_true", help="every program")
    parser.add_argument("--only", default=None, help="comma list of case names")
    args = parser.parse_args()
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S')}, load {os.getloadavg()[0]:.2f}\n")
    cuda = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    for case in CASES:
        if args.only and case[0] not in args.only.split(","):
            continue
        if case[2].startswith(("h100", "h200", "a100")) and not cuda:
            print(f"{case[0]}: skipped (no JAX CUDA plugin: pip install 'jax[cuda12]')\n")
            continue
        run(case, args.every)


if __name__ == "__main__":
    main()
