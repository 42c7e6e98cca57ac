"""Host cost of one engine step: Scheduler.schedule() + update_from_output().

Decode-heavy steady state at 64, 256 and 1024 running requests: prompts of 128-512 tokens
with a shared system prefix, outputs of 64-512 tokens, a finished request replaced by a new
arrival (whose prefill is chunked into the same steps). The model runner is a stub that
samples one token per finished prefill; its cost is not timed.

    python benchmarks/scheduler.py            # table, benchmarks/scheduler.json, RESULTS.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Import xlm from this checkout even when another one is installed.
sys.path.insert(0, str(HERE.parent))
# This folder only while common.py is imported (its kernels.py shadows a package name).
sys.path.insert(0, str(HERE))
from common import cpu_model  # noqa: E402

sys.path.pop(0)

from xlm.config import CacheConfig, SchedulerConfig  # noqa: E402
from xlm.core.outputs import ModelRunnerOutput  # noqa: E402
from xlm.core.request import Request  # noqa: E402
from xlm.core.scheduler import Scheduler  # noqa: E402

BLOCK_SIZE = 16


@dataclass
class _SP:
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = True
    stop_token_ids: list[int] | None = None


def run(num_running: int, num_steps: int, freeze_gc: bool = False, seed: int = 0) -> dict:
    """Measure num_steps steady-state steps at num_running running requests.

    freeze_gc: after warm-up, gc.freeze() the long-lived objects (the block pool, requests),
    as an engine process should once it has started, so collections stop rescanning them.
    """
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(64)]
    max_len = 1024
    sched = Scheduler(
        SchedulerConfig(
            # Room for every decode plus the prefills of the arrivals.
            max_num_batched_tokens=num_running + 2048,
            max_num_seqs=num_running,
            max_model_len=max_len,
        ),
        CacheConfig(block_size=BLOCK_SIZE),
        num_blocks=num_running * max_len // BLOCK_SIZE + 1,
    )
    counter = 0

    def arrive() -> None:
        nonlocal counter
        prompt = system + [rng.randrange(32000) for _ in range(rng.randrange(64, 448))]
        sp = _SP(max_tokens=rng.randrange(64, 512))
        sched.add_request(Request(f"req-{counter}", prompt, sp, eos_token_id=2))
        counter += 1

    def runner(so) -> ModelRunnerOutput:
        ids, sampled = [], []
        requests = sched.requests
        for rid in so.num_scheduled_tokens:
            r = requests[rid]
            ids.append(rid)
            sampled.append([r.num_tokens % 32000] if r.num_computed_tokens == r.num_tokens else [])
        return ModelRunnerOutput(ids, sampled)

    for _ in range(num_running):
        arrive()
    # Warm up into steady state: everyone admitted and decoding, some already replaced.
    for _ in range(200):
        so = sched.schedule()
        sched.update_from_output(so, runner(so))
        while sched.get_num_unfinished_requests() < num_running + 2:
            arrive()

    gc.collect()
    if freeze_gc:
        gc.freeze()
    sched_ns, update_ns, cpu_ns, reqs, tokens = [], [], [], [], []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for _ in range(num_steps):
        c0 = cpu_clock()
        t0 = clock()
        so = sched.schedule()
        t1 = clock()
        c1 = cpu_clock()
        mro = runner(so)
        c2 = cpu_clock()
        t2 = clock()
        sched.update_from_output(so, mro)
        t3 = clock()
        c3 = cpu_clock()
        sched_ns.append(t1 - t0)
        update_ns.append(t3 - t2)
        cpu_ns.append(c1 - c0 + c3 - c2)
        reqs.append(len(so.num_scheduled_tokens))
        tokens.append(so.total_num_scheduled_tokens)
        while sched.get_num_unfinished_requests() < num_running + 2:
            arrive()
    if freeze_gc:
        gc.unfreeze()
    step_us = [(a + b) / 1e3 for a, b in zip(sched_ns, update_ns)]
    mean_reqs = statistics.fmean(reqs)
    stats = sched.make_stats()
    return {
        "num_running": num_running,
        "gc": "frozen" if freeze_gc else "default",
        "steps": num_steps,
        "mean_scheduled_reqs": round(mean_reqs, 1),
        "mean_scheduled_tokens": round(statistics.fmean(tokens), 1),
        "schedule_us": round(statistics.fmean(sched_ns) / 1e3, 1),
        "update_us": round(statistics.fmean(update_ns) / 1e3, 1),
        "step_us_mean": round(statistics.fmean(step_us), 1),
        "step_us_p50": round(statistics.median(step_us), 1),
        "step_us_p99": round(sorted(step_us)[int(0.99 * (len(step_us) - 1))], 1),
        "us_per_request": round(statistics.fmean(step_us) / mean_reqs, 2),
        # CPU time of this thread: what the step costs, without time lost to other processes.
        "cpu_us_mean": round(statistics.fmean(cpu_ns) / 1e3, 1),
        "cpu_us_per_request": round(statistics.fmean(cpu_ns) / 1e3 / mean_reqs, 2),
        "arrivals": counter - num_running,
        "prefix_hit_rate": round(stats.prefix_cache_hit_rate, 3),
        "kv_usage": round(stats.kv_cache_usage, 3),
    }


def _table(rows: list[dict]) -> str:
    head = (
        "| running | gc | sched reqs/step | tokens/step | schedule µs | update µs "
        "| step µs mean | p50 | p99 | µs/request | CPU µs/step | CPU µs/request |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['num_running']} | {r['gc']} | {r['mean_scheduled_reqs']} "
            f"| {r['mean_scheduled_tokens']} "
            f"| {r['schedule_us']} | {r['update_us']} | {r['step_us_mean']} | {r['step_us_p50']} "
            f"| {r['step_us_p99']} | {r['us_per_request']} | {r['cpu_us_mean']} "
            f"| {r['cpu_us_per_request']} |"
        )
    return "\n".join(lines)


def _update_results_md(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find("\n## Scheduler\n")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[: start + 1] + section + ("" if end == -1 else text[end:])
    path.write_text(text.rstrip("\n") + "\n")


def main() -> None:
    """Run the sizes, print the table, write JSON and the RESULTS.md section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per row; the one with the lowest mean is kept"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    gc.collect()
    load_before = os.getloadavg()[0]
    rows = []
    for n in args.sizes:
        for freeze in (False, True):
            runs = [run(n, args.steps, freeze) for _ in range(args.repeats)]
            rows.append(min(runs, key=lambda r: r["cpu_us_mean"]))
    load_after = os.getloadavg()[0]
    table = _table(rows)
    print(table)
    if args.no_write:
        return
    command = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    meta = {
        "machine": machine,
        "python": platform.python_version(),
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "block_size": BLOCK_SIZE,
        "loadavg_1min": [round(load_before, 2), round(load_after, 2)],
    }
    (HERE / "scheduler.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    section = (
        "## Scheduler\n\n"
        "Host cost of one step, `Scheduler.schedule()` + `update_from_output()`, in "
        "decode-heavy steady state: prompts of 128-512 tokens sharing a 64-token prefix, "
        "outputs of 64-512 tokens, each finished request replaced by a new arrival whose "
        f"prefill is chunked into the same steps; block size {BLOCK_SIZE}, prefix caching on; "
        "the stub model runner is not timed.\n\n"
        "- Each row is the best (lowest CPU mean) of `--repeats` runs.\n"
        "- CPU columns: this thread's CPU time (`time.thread_time_ns`), which excludes time "
        "lost to other processes on this shared machine: the figure to compare across runs. "
        "The other columns are wall-clock; µs/request is a step divided by the requests in it.\n"
        "- gc `frozen`: `gc.freeze()` after warm-up, so collections stop rescanning the block "
        "pool (~65k blocks at 1024 requests), as the engine core should do once started; "
        "`default`: the collector as is, whose full collections set the p99.\n\n"
        f"{table}\n\n"
        f"Machine: {machine}; Python {meta['python']}; {meta['date']}; 1-minute load "
        f"average {load_before:.1f} before, {load_after:.1f} after.  \n"
        f"Command: `{command}` (JSON: `benchmarks/scheduler.json`).\n"
    )
    _update_results_md(HERE / "RESULTS.md", section)


if __name__ == "__main__":
    main()
