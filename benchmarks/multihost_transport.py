"""Per-step cost of the multihost step channel: process 0 -> a follower over ZeroMQ/TCP.

What a follower receives every step is the scheduler output, pickled once by the leader.
Measured on 127.0.0.1 between two processes (the real LeaderChannel/FollowerChannel):
pickling on the leader (on its step's critical path), and the one-way time from before
pickling to the follower holding the unpickled SchedulerOutput. Decode steps at batch 1
and 64 (every request one token; one in sixteen gets a new block), and a prefill step of
64 new 128-token requests. Steps are spaced 5 ms apart so latency, not throughput, is
measured.

    python benchmarks/multihost_transport.py      # table + benchmarks/multihost_transport.json
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from xlm.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from xlm.sampling_params import SamplingParams  # noqa: E402

STEPS = 300
PORT = int(os.environ.get("XLM_BENCH_PORT", "29733"))


def decode_step(batch: int, step: int) -> SchedulerOutput:
    ids = [f"req-{i}" for i in range(batch)]
    cached = CachedRequestData(
        req_ids=ids,
        resumed_from_preemption=[False] * batch,
        new_block_ids=[[1000 + i] if (i + step) % 16 == 0 else [] for i in range(batch)],
        num_computed_tokens=[300 + step] * batch,
        new_token_ids=[[] for _ in range(batch)],
    )
    return SchedulerOutput([], cached, dict.fromkeys(ids, 1), batch, set(), set())


def prefill_step(batch: int, step: int) -> SchedulerOutput:
    new = [
        NewRequestData(
            f"req-{step}-{i}",
            list(range(128)),
            SamplingParams(max_tokens=256, temperature=0.7),
            list(range(8 * i, 8 * i + 8)),
            0,
        )
        for i in range(batch)
    ]
    num = {r.req_id: 128 for r in new}
    return SchedulerOutput(new, CachedRequestData(), num, 128 * batch, set(), set())


CASES = {
    "decode batch 1": lambda s: decode_step(1, s),
    "decode batch 64": lambda s: decode_step(64, s),
    "prefill 64 x 128 tokens": lambda s: prefill_step(64, s),
}


def follower(results) -> None:
    from xlm.executor.step_channel import FollowerChannel

    channel = FollowerChannel("127.0.0.1", PORT, 1, timeout_s=60.0)
    latencies: dict[str, list[float]] = {}
    while True:
        name, sent, _ = channel.recv()
        arrived = time.monotonic()
        if name == "done":
            break
        latencies.setdefault(name, []).append(arrived - sent)
    results.put(latencies)
    channel.close()


def main() -> None:
    from xlm.executor.step_channel import LeaderChannel

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=follower, args=(results,))
    proc.start()
    channel = LeaderChannel("127.0.0.1", PORT, 2, timeout_s=60.0)
    pickle_s: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    for name, make in CASES.items():
        for step in range(STEPS):
            so = make(step)
            start = time.monotonic()
            channel.send((name, start, so))
            pickle_s.setdefault(name, []).append(time.monotonic() - start)
            time.sleep(0.005)
        sizes[name] = len(pickle.dumps(("execute_model", (so,)), pickle.HIGHEST_PROTOCOL))
    channel.send(("done", time.monotonic(), None))
    latencies = results.get(timeout=60)
    proc.join(10)
    channel.close()
    rows = []
    for name in CASES:
        lat = sorted(latencies[name])
        rows.append(
            {
                "case": name,
                "bytes": sizes[name],
                "leader_send_us_median": 1e6 * statistics.median(pickle_s[name]),
                "one_way_us_median": 1e6 * statistics.median(lat),
                "one_way_us_p99": 1e6 * lat[int(0.99 * (len(lat) - 1))],
            }
        )
    print(f"{'case':<26}{'bytes':>8}{'leader send us':>16}{'one-way us p50':>16}{'p99':>10}")
    for r in rows:
        print(
            f"{r['case']:<26}{r['bytes']:>8}{r['leader_send_us_median']:>16.0f}"
            f"{r['one_way_us_median']:>16.0f}{r['one_way_us_p99']:>10.0f}"
        )
    load = os.getloadavg()
    out = {"rows": rows, "steps": STEPS, "loadavg": load}
    (HERE / "multihost_transport.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"load average {load[0]:.1f} (2 cores shared: timings are contaminated)")


if __name__ == "__main__":
    main()
