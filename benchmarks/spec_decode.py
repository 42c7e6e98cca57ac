"""Speculative decoding (n-gram) on vs off: one request at a time, and a batch of 64.

Each mode runs in its own process (`--one MODE` is that process) on the built-in model,
every program compiled before anything is timed, one untimed warm-up pass. Workloads,
built from the real passages of `peers_prompts.txt` through the model's chat template:

- `grounded`: the answer copies spans of the prompt (repeat a passage, correct the
  spelling of a passage with a few typos, copy its first two sentences, rename a variable
  in a code block): where prompt lookup finds its proposals.
- `chat`: ordinary questions whose answers are not in the prompt.
- `batch`: 64 passages as completion prompts, 128 tokens each, EOS ignored.

Single requests are greedy with EOS on, at most 128 tokens; decode tok/s of a request is
(tokens - 1) / (finish - first token) from the engine's own timestamps. Greedy outputs are
compared across modes (they must be equal).

    python benchmarks/spec_decode.py [--modes off,ngram4,ngram2] [--out benchmarks/spec_decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "peers_prompts.txt")

MODES = {
    "off": None,
    "ngram4": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram2": {"method": "ngram", "num_speculative_tokens": 2},
}

CHAT = [
    "What are three good habits for staying healthy? Explain each briefly.",
    "Write a short story about a robot who learns to paint.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Give me some tips for learning a new language.",
    "What is the difference between weather and climate?",
    "Describe a typical day of a medieval farmer.",
    "How do airplanes stay in the air?",
    "Suggest a plan for a weekend trip to the mountains.",
]

CODE = """def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price * item.count
    return subtotal * (1 + tax)
"""


def passages() -> list[str]:
    with open(PROMPTS) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]


def with_typos(text: str) -> str:
    """Swap two letters in every seventh word (a fixed, repeatable corruption)."""
    words = text.split()
    for i in range(3, len(words), 7):
        w = words[i]
        if len(w) > 4:
            words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def grounded_prompts() -> list[str]:
    texts = [t[:600] for t in passages()[:6]]
    return [
        f"Repeat the following text word for word:\n\n{texts[0]}",
        f"Correct the spelling mistakes in this text and return the corrected text:\n\n"
        f"{with_typos(texts[1])}",
        f"Copy the first two sentences of this text exactly:\n\n{texts[2]}",
        f"Rename the variable subtotal to running_total in this code:\n\n{CODE}",
        f"Repeat the following text word for word:\n\n{texts[3]}",
        f"Correct the spelling mistakes in this text and return the corrected text:\n\n"
        f"{with_typos(texts[4])}",
        f"Copy the first two sentences of this text exactly:\n\n{texts[5]}",
        f"Rewrite this code with the variable items renamed to products:\n\n{CODE}",
    ]


def run_one(mode: str, args: argparse.Namespace) -> dict:
    import xlm

    spec = MODES[mode]
    start = time.perf_counter()
    llm = xlm.LLM(
        model=args.model,
        max_model_len=1024,
        compile_all_first=True,
        **({"speculative_config": spec} if spec else {}),
    )
    load_s = time.perf_counter() - start
    single = xlm.SamplingParams(temperature=0.0, max_tokens=args.single_len)
    result: dict = {"mode": mode, "speculative_config": spec, "load_s": load_s}
    for name, prompts in (("grounded", grounded_prompts()), ("chat", CHAT)):
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        llm.chat(conversations[:2], single, use_tqdm=False)  # warm-up
        before = llm.get_stats()
        rows = []
        for conv in conversations:
            (out,) = llm.chat([conv], single, use_tqdm=False)
            m = out.metrics
            n = len(out.outputs[0].token_ids)
            decode_s = m.finished_time - m.first_token_time
            rows.append(
                {
                    "tokens": n,
                    "ttft_s": m.first_token_time - m.arrival_time,
                    "decode_s": decode_s,
                    "tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
                    "token_ids": list(out.outputs[0].token_ids),
                }
            )
        after = llm.get_stats()
        drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        verifications = after.spec_num_drafts - before.spec_num_drafts
        total_tokens = sum(r["tokens"] - 1 for r in rows)
        total_s = sum(r["decode_s"] for r in rows)
        result[name] = {
            "rows": rows,
            "decode_tok_s": total_tokens / total_s,
            "median_tok_s": statistics.median(r["tok_s"] for r in rows if r["tok_s"]),
            "proposed": drafts,
            "accepted": accepted,
            "acceptance_rate": accepted / drafts if drafts else None,
            "mean_accepted_length": 1 + accepted / verifications if verifications else None,
        }
    texts = passages()
    batch_prompts = [texts[i % len(texts)][: 80 + 40 * (i % 8)] for i in range(args.batch)]
    batch = xlm.SamplingParams(temperature=0.0, max_tokens=args.batch_len, ignore_eos=True)
    llm.generate(batch_prompts[:8], batch, use_tqdm=False)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.generate(batch_prompts, batch, use_tqdm=False)
        times.append(time.perf_counter() - start)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result["batch"] = {
        "requests": args.batch,
        "tokens": tokens,
        "seconds": times,
        "tok_s": tokens / statistics.median(times),
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--modes", default="off,ngram4,ngram2")
    parser.add_argument("--single-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="before each mode, wait (up to 5 minutes) for the 1-minute load average to "
        "fall below this (the previous mode's process keeps it up for a while)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--one", mode, "--model", args.model]
        cmd += ["--single-len", str(args.single_len), "--batch", str(args.batch)]
        cmd += ["--batch-len", str(args.batch_len), "--repeats", str(args.repeats)]
        deadline = time.monotonic() + 300
        while os.getloadavg()[0] >= args.settle and time.monotonic() < deadline:
            time.sleep(5)
        load = os.getloadavg()[0]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        result["load_before"] = load
        results.append(result)
    base = results[0]
    print(
        "| mode | workload | decode tok/s | median tok/s | vs off | accepted/proposed | "
        "mean accepted length | greedy equal to off |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for name in ("grounded", "chat"):
            w, b = r[name], base[name]
            same = [x["token_ids"] for x in w["rows"]] == [x["token_ids"] for x in b["rows"]]
            rate = f"{w['accepted']}/{w['proposed']}" if w["proposed"] else "-"
            mal = f"{w['mean_accepted_length']:.2f}" if w["mean_accepted_length"] else "-"
            print(
                f"| {r['mode']} | {name} | {w['decode_tok_s']:.1f} | {w['median_tok_s']:.1f} | "
                f"{w['decode_tok_s'] / b['decode_tok_s']:.2f}x | {rate} | {mal} | {same} |"
            )
        bb = r["batch"]
        same = bb["token_ids"] == base["batch"]["token_ids"]
        print(
            f"| {r['mode']} | batch {bb['requests']} x {args.batch_len} | {bb['tok_s']:.1f} | - | "
            f"{bb['tok_s'] / base['batch']['tok_s']:.2f}x | - | - | {same} |"
        )
    print("load average before each mode:", {r["mode"]: r["load_before"] for r in results})
    if args.out:
        for r in results:
            for name in ("grounded", "chat"):
                for row in r[name]["rows"]:
                    row.pop("token_ids")
            r["batch"].pop("token_ids")
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
