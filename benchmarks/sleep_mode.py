"""Sleep mode and weight updates: how long sleep / wake_up / update_weights take, and what
they free.

One engine with sleep mode on, idle between calls: each repeat runs sleep(1) + wake_up(),
sleep(2) + wake_up() and update_weights(the model's own checkpoint), timing each call and
checking that a greedy completion is unchanged and nothing compiled. The first repeat is
reported but left out of the medians. Weight bytes over a call's time is its effective
bandwidth (level 1: device <-> host copies; level 2 and update_weights: reading the files).

    python benchmarks/sleep_mode.py [--model smollm2-135m] [--repeats 3] \
        [--out benchmarks/sleep_mode.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

GiB = 1 << 30
OPS = ("sleep(1)", "wake_up(1)", "sleep(2)", "wake_up(2)", "update_weights")


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", default=None, help="write the per-repeat figures as JSON")
    args = parser.parse_args()

    import xlm
    from xlm.models.builtin import resolve_model_name

    path = resolve_model_name(args.model)
    llm = xlm.LLM(
        model=path, enable_sleep_mode=True, max_model_len=args.max_model_len, startup_programs="all"
    )
    engine = llm.llm_engine
    greedy = xlm.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def completion() -> list[int]:
        return (
            llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )

    reference = completion()
    compiled = engine.num_compilations
    held = engine.device_bytes()
    rows: list[dict] = []
    for repeat in range(args.repeats):
        row: dict = {"repeat": repeat}
        for level in (1, 2):
            start = time.perf_counter()
            freed = llm.sleep(level)
            row[f"sleep({level})"] = time.perf_counter() - start
            row[f"freed_gib({level})"] = (freed["weights"] + freed["kv_cache"]) / GiB
            row[f"wake_up({level})"] = timed(llm.wake_up)
            assert completion() == reference, f"level {level}: the completion changed"
        row["update_weights"] = timed(llm.update_weights, path)
        assert completion() == reference, "update_weights(same checkpoint) changed the output"
        assert engine.num_compilations == compiled, "a program compiled"
        rows.append(row)
        print(f"repeat {repeat}: " + ", ".join(f"{op} {row[op]:.3f} s" for op in OPS), flush=True)

    kept = rows[1:] or rows
    weights_gib = held["weights"] / GiB
    print(
        f"\n{args.model}: weights {weights_gib:.3f} GiB, KV cache {held['kv_cache'] / GiB:.3f} "
        f"GiB on the devices; medians of {len(kept)} repeats"
    )
    print(f"{'call':<16}{'median s':>10}{'weights GiB/s':>15}")
    for op in OPS:
        median = statistics.median(r[op] for r in kept)
        print(f"{op:<16}{median:>10.3f}{weights_gib / median:>15.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "held_bytes": held, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
