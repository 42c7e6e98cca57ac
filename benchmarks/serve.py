"""Serving benchmark: latency and throughput of `xlm serve` at several client concurrencies.

Our own async client (httpx, streamed /v1/completions) measures, per concurrency level:
request throughput, output tokens/s, TTFT, TPOT (time per output token after the first)
and ITL (time between streamed chunks): mean, median and p99, in the spirit of
`vllm bench serve`. Writes a table to stdout, JSON and a PNG (latency vs throughput).

    python benchmarks/serve.py --launch "smollm2-135m --max-model-len 512" \
        --concurrencies 1,4,16,32 --output-len 64

or against a running server: `--base-url http://127.0.0.1:8000`. 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "time people year way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
).split()


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds)."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    """Deterministic synthetic prompts of about `words` words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def one_request(
    http: httpx.AsyncClient, model: str, prompt: str, output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                now = time.perf_counter()
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
                if data["choices"] and data["choices"][0]["text"]:
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        "mean_ms": 1000 * statistics.fmean(values),
        "median_ms": 1000 * statistics.median(values),
        "p99_ms": 1000 * p99,
    }


async def run_level(
    headers: dict[str, str],
    base_url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    output_len: int,
    timeout: float,
) -> dict:
    """Send every prompt with at most `concurrency` in flight; summarize."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=timeout, headers=headers
    ) as http:
        semaphore = asyncio.Semaphore(concurrency)

        async def bounded(prompt: str) -> RequestResult:
            async with semaphore:
                return await one_request(http, model, prompt, output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        duration = time.perf_counter() - start
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "completed": len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "request_throughput": len(good) / duration,
        "output_throughput": out_tokens / duration,
        "total_prompt_tokens": sum(r.prompt_tokens for r in good),
        "total_output_tokens": out_tokens,
        "ttft": _stats([r.ttft for r in good]),
        "tpot": _stats(tpots),
        "itl": _stats([x for r in good for x in r.itls]),
        "e2e": _stats([r.e2e for r in good]),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(serve_args: str, startup_timeout: float) -> tuple[subprocess.Popen, str]:
    """Start `xlm serve ARGS` from this checkout on 127.0.0.1; wait for /health."""
    port = _free_port()
    env = dict(
        os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    env.setdefault("XLM_DISABLE_PROGRESS_BARS", "1")
    cmd = [
        sys.executable,
        "-m",
        "xlm.entrypoints.cli",
        "serve",
        *shlex.split(serve_args),
        "--startup-programs",
        "all",  # steady state: /health once every program is ready
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO_ROOT))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"xlm serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("xlm serve did not become healthy")


def plot(levels: list[dict], path: Path, title: str) -> None:
    """Latency (TTFT, TPOT, ITL p99) against output throughput, one point per concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [lv["output_throughput"] for lv in levels]
    for key, style in (("mean_ms", "o-"), ("p99_ms", "s--")):
        ax1.plot(x, [lv["ttft"][key] for lv in levels], style, label=f"TTFT {key[:-3]}")
        ax2.plot(x, [lv["tpot"][key] for lv in levels], style, label=f"TPOT {key[:-3]}")
        ax2.plot(x, [lv["itl"][key] for lv in levels], style, alpha=0.5, label=f"ITL {key[:-3]}")
    for ax in (ax1, ax2):
        for lv, xi in zip(levels, x):
            ax.annotate(
                f"c={lv['concurrency']}",
                (xi, ax.get_ylim()[0]),
                fontsize=7,
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
            )
        ax.set_xlabel("output throughput (tokens/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("time to first token (ms)")
    ax2.set_ylabel("per-token latency (ms)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(levels: list[dict]) -> None:
    """One row per concurrency level."""
    head = (
        f"{'conc':>4} {'reqs':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT mean':>9} "
        f"{'TTFT p99':>9} {'TPOT mean':>9} {'TPOT p99':>9} {'ITL mean':>9} {'ITL p99':>9}"
    )
    print(head)
    for lv in levels:
        print(
            f"{lv['concurrency']:>4} {lv['completed']:>5} {lv['request_throughput']:>7.2f} "
            f"{lv['output_throughput']:>9.1f} {lv['ttft']['mean_ms']:>9.1f} "
            f"{lv['ttft']['p99_ms']:>9.1f} {lv['tpot']['mean_ms']:>9.1f} "
            f"{lv['tpot']['p99_ms']:>9.1f} {lv['itl']['mean_ms']:>9.1f} "
            f"{lv['itl']['p99_ms']:>9.1f}"
        )
    print("(latencies in ms; TPOT excludes the first token; ITL is per streamed chunk)")


def offline_baseline(serve_args: str, prompts: list[str], output_len: int) -> dict:
    """The same engine in-process (xlm.LLM) on the same prompts: the no-server reference."""
    import argparse

    from xlm.engine.arg_utils import EngineArgs
    from xlm.entrypoints.llm import LLM
    from xlm.entrypoints.openai.cli_args import finish_args, make_arg_parser
    from xlm.sampling_params import SamplingParams

    args = finish_args(make_arg_parser(argparse.ArgumentParser()), shlex.split(serve_args))
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    try:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - start
    finally:
        llm.llm_engine.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "num_requests": len(prompts),
        "duration_s": duration,
        "request_throughput": len(prompts) / duration,
        "output_throughput": tokens / duration,
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("xlm", "jax", "jaxlib", "fastapi", "uvicorn", "pyzmq", "httpx"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", help="start `xlm serve` with these arguments")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if any")
    parser.add_argument("--model", default=None, help="model name (default: the first served)")
    parser.add_argument("--concurrencies", default="1,4,16,32")
    parser.add_argument(
        "--requests-per-level",
        type=int,
        default=0,
        help="requests per level (default: 4 x concurrency, 8..96)",
    )
    parser.add_argument("--input-words", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--offline-baseline",
        action="store_true",
        help="with --launch: also run the same engine in-process on the last level's prompts",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "serve.json"))
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    proc = None
    base_url = args.base_url
    if args.launch:
        proc, base_url = launch_server(args.launch, args.startup_timeout)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(base_url + "/v1/models", headers=headers).json()
        model = args.model or models["data"][0]["id"]
        levels = []
        asyncio.run(
            run_level(
                headers,
                base_url,
                model,
                make_prompts(2, args.input_words, 999),
                2,
                args.output_len,
                args.timeout,
            )
        )  # warm-up
        for concurrency in (int(c) for c in args.concurrencies.split(",")):
            n = args.requests_per_level or max(8, min(96, 4 * concurrency))
            prompts = make_prompts(n, args.input_words, args.seed + concurrency)
            level = asyncio.run(
                run_level(
                    headers, base_url, model, prompts, concurrency, args.output_len, args.timeout
                )
            )
            levels.append(level)
            print(
                f"concurrency {concurrency}: {level['completed']}/{n} ok, "
                f"{level['output_throughput']:.1f} out tok/s",
                flush=True,
            )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print_table(levels)
    baseline = None
    if args.offline_baseline and args.launch:
        last = levels[-1]
        prompts = make_prompts(
            last["num_requests"], args.input_words, args.seed + last["concurrency"]
        )
        baseline = offline_baseline(args.launch, prompts, args.output_len)
        ratio = last["output_throughput"] / baseline["output_throughput"]
        print(
            f"offline xlm.LLM, same engine and prompts: {baseline['output_throughput']:.1f} "
            f"out tok/s; serve at concurrency {last['concurrency']} reaches {ratio:.2f}x of it"
        )
        baseline["serve_over_offline"] = ratio
    out = Path(args.out)
    report = {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "versions": _versions(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "model": model,
        "input_words": args.input_words,
        "output_len": args.output_len,
        "levels": levels,
        "offline_baseline": baseline,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(
        levels,
        out.with_suffix(".png"),
        f"xlm serve {model}: latency vs throughput "
        f"({args.input_words}-word prompts, {args.output_len} output tokens)",
    )
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
