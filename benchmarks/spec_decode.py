"""Speculative decoding (n-gram, draft model) on vs off: one request, and a batch of 64.

Each mode runs in its own process (`--one MODE` is that process) on the built-in model,
every program compiled before anything is timed, one untimed warm-up pass. With
`--llama-python PYTHON` (a venv with llama-cpp-python), llama.cpp runs the same single
requests on an F32 GGUF of the same weights, without and with its prompt-lookup decoding
(`LlamaPromptLookupDecoding`), as the peer a user would pick instead. Workloads,
built from the real passages of `peers_prompts.txt` through the model's chat template:

- `grounded`: the answer copies spans of the prompt (repeat a passage, correct the
  spelling of a passage with a few typos, copy its first two sentences, rename a variable
  in a code block): where prompt lookup finds its proposals.
- `chat`: ordinary questions whose answers are not in the prompt.
- `batch`: 64 passages as completion prompts, 128 tokens each, EOS ignored.

Single requests are greedy with EOS on, at most 128 tokens; decode tok/s of a request is
(tokens - 1) / (finish - first token) from the engine's own timestamps (llama.cpp: the
request's time less a 1-token request's time on the same prompt, each from an empty
context). xlm's greedy outputs are compared across modes (they must be equal).

    python benchmarks/spec_decode.py [--modes off,ngram3,ngram5] \
        [--llama-python /path/venv/bin/python] [--out benchmarks/spec_decode.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "peers_prompts.txt")

MODES = {
    "off": None,
    "ngram3": {"method": "ngram", "num_speculative_tokens": 3},
    "ngram5": {"method": "ngram", "num_speculative_tokens": 5},
    # Draft models: the first 8 or 24 of SmolLM2's 30 layers with its own final norm and
    # head (no smaller model shares its tokenizer here), and the model drafting for itself
    # (every proposal accepted, at the full model's cost: the upper bound of acceptance).
    "draft8": {"method": "draft_model", "model": "truncated:8", "num_speculative_tokens": 3},
    "draft24": {"method": "draft_model", "model": "truncated:24", "num_speculative_tokens": 3},
    "draft-self": {"method": "draft_model", "model": "self", "num_speculative_tokens": 3},
}
# llama.cpp modes: its own decoding, and its prompt lookup (3 tokens from 3-grams).
LLAMA_MODES = {"llama-off": None, "llama-lookup": {"num_pred_tokens": 3, "max_ngram_size": 3}}

LLAMA_SCRIPT = """
import json, sys, time
from llama_cpp import Llama, __version__
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
job = json.load(sys.stdin)
draft = LlamaPromptLookupDecoding(**job["lookup"]) if job["lookup"] else None
llm = Llama(model_path=job["gguf"], n_ctx=2048, n_threads=job["threads"], verbose=False,
            draft_model=draft)
def run(messages, max_tokens):
    llm.reset()  # an empty context: no prefix kept from the previous request
    start = time.perf_counter()
    out = llm.create_chat_completion(messages, max_tokens=max_tokens, temperature=0.0)
    return time.perf_counter() - start, out["usage"]["completion_tokens"]
result = {"version": __version__}
for name, conversations in job["workloads"].items():
    run(conversations[0], 8)  # warm-up
    rows = []
    for messages in conversations:
        ttft, _ = run(messages, 1)
        total, n = run(messages, job["max_tokens"])
        decode = total - ttft
        rows.append({"tokens": n, "ttft_s": ttft, "decode_s": decode,
                     "tok_s": (n - 1) / decode if n > 1 and decode > 0 else None})
    result[name] = rows
print(json.dumps(result))
"""

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


def summarize(rows: list[dict]) -> dict:
    total_tokens = sum(r["tokens"] - 1 for r in rows)
    total_s = sum(r["decode_s"] for r in rows)
    return {
        "rows": rows,
        "decode_tok_s": total_tokens / total_s,
        "median_tok_s": statistics.median(r["tok_s"] for r in rows if r["tok_s"]),
    }


def f32_gguf(model: str) -> str:
    """An F32 GGUF of the model's weights for llama.cpp (benchmarks/peers.py makes it)."""
    spec = importlib.util.spec_from_file_location("peers", os.path.join(HERE, "peers.py"))
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    work = Path(os.environ.get("XLM_PEERS_DIR", "/tmp/xlm-peers"))
    work.mkdir(parents=True, exist_ok=True)
    return peers.prepare_weights(model, work)["gguf_f32"]


def run_llama(mode: str, args: argparse.Namespace) -> dict:
    workloads = {
        name: [[{"role": "user", "content": p}] for p in prompts]
        for name, prompts in (("grounded", grounded_prompts()), ("chat", CHAT))
    }
    job = {
        "gguf": f32_gguf(args.model),
        "threads": os.cpu_count(),
        "lookup": LLAMA_MODES[mode],
        "max_tokens": args.single_len,
        "workloads": workloads,
    }
    out = subprocess.run(
        [args.llama_python, "-c", LLAMA_SCRIPT],
        input=json.dumps(job),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    raw = json.loads(out.strip().splitlines()[-1])
    result: dict = {"mode": mode, "speculative_config": LLAMA_MODES[mode]}
    result["llama_cpp_python"] = raw["version"]
    for name in workloads:
        result[name] = summarize(raw[name])
    return result


def truncated_draft(model: str, layers: int) -> str:
    """A checkpoint of the model's first `layers` layers, with its embedding, final norm
    and head (from the HF directory benchmarks/peers.py converts the GGUF to)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    spec = importlib.util.spec_from_file_location("peers", os.path.join(HERE, "peers.py"))
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    work = Path(os.environ.get("XLM_PEERS_DIR", "/tmp/xlm-peers"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = Path(peers.prepare_weights(model, work)["hf_dir"])
    out = work / f"{hf_dir.name}.first{layers}"
    if (out / "model.safetensors").exists():
        return str(out)
    out.mkdir(exist_ok=True)
    tensors = {}
    for file in hf_dir.glob("*.safetensors"):
        for name, value in load_file(file).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            tensors[name] = value
    for file in hf_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    config = json.loads((hf_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def resolve_draft(spec: dict | None, model: str) -> dict | None:
    """The mode's draft model as a path ("self": the model; "truncated:N": its first N
    layers)."""
    if spec is None or spec.get("method") != "draft_model":
        return spec
    draft = spec["model"]
    if draft == "self":
        draft = model
    elif draft.startswith("truncated:"):
        draft = truncated_draft(model, int(draft.split(":")[1]))
    return {**spec, "model": draft}


def dot_costs(model: str) -> dict:
    """XLA:CPU's float32 dot for M = 1..8 rows against the model's largest weights (the
    LM head, hidden x vocab, and the MLP's up projection): what a step verifying M - 1
    proposals pays per matmul. Median of 50 runs after 5."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from xlm.models.builtin import resolve_model_name
    from xlm.models.loader import load_hf_config

    config = load_hf_config(resolve_model_name(model), "auto")
    shapes = {
        "lm_head": (config.hidden_size, config.vocab_size),
        "mlp_up": (config.hidden_size, config.intermediate_size),
    }
    out: dict = {}
    rng = np.random.default_rng(0)
    for name, (k, n) in shapes.items():
        w = jnp.asarray(rng.standard_normal((k, n), np.float32))
        dot = jax.jit(jnp.dot)
        out[name] = {"shape": [k, n]}
        for m in (1, 2, 4, 8):
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            for _ in range(5):
                dot(x, w).block_until_ready()
            times = []
            for _ in range(50):
                start = time.perf_counter()
                dot(x, w).block_until_ready()
                times.append(time.perf_counter() - start)
            out[name][m] = statistics.median(times)
    return out


def run_one(mode: str, args: argparse.Namespace) -> dict:
    import xlm

    spec = resolve_draft(MODES[mode], args.model)
    start = time.perf_counter()
    llm = xlm.LLM(
        model=args.model,
        max_model_len=1024,
        startup_programs="all",
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
        result[name] = {
            **summarize(rows),
            "proposed": drafts,
            "accepted": accepted,
            "acceptance_rate": accepted / drafts if drafts else None,
            "mean_accepted_length": 1 + accepted / verifications if verifications else None,
        }
    # What the policy measured: step seconds by token bucket (1 token = a plain decode
    # step; 2-8 = one request verifying 1-7 proposals) and a draft round's seconds.
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    if spec:
        result["policy_step_s"] = dict(sorted(runner.speculator.policy.step_s.items()))
        result["draft_round_s"] = dict(sorted(getattr(runner.proposer, "_round_s", {}).items()))
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
    parser.add_argument("--modes", default="off,ngram3,ngram5,draft24,draft-self")
    parser.add_argument(
        "--llama-python",
        default=None,
        help="python of a venv with llama-cpp-python: also run llama.cpp without and with "
        "its prompt-lookup decoding",
    )
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
    if args.one == "dot":
        print(json.dumps(dot_costs(args.model)))
        return
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    modes = args.modes.split(",") + (list(LLAMA_MODES) if args.llama_python else [])
    results = []
    dots = None
    for mode in modes:
        cmd = [sys.executable, __file__, "--one", mode, "--model", args.model]
        cmd += ["--single-len", str(args.single_len), "--batch", str(args.batch)]
        cmd += ["--batch-len", str(args.batch_len), "--repeats", str(args.repeats)]
        deadline = time.monotonic() + 300
        while os.getloadavg()[0] >= args.settle and time.monotonic() < deadline:
            time.sleep(5)
        load = os.getloadavg()[0]
        if mode == "off" and dots is None:  # once, in its own process, before the modes
            cmd_dot = [sys.executable, __file__, "--one", "dot", "--model", args.model]
            out = subprocess.run(cmd_dot, check=True, capture_output=True, text=True).stdout
            dots = json.loads(out.strip().splitlines()[-1])
            dots["load_before"] = load
            load = os.getloadavg()[0]
        if mode in LLAMA_MODES:
            result = run_llama(mode, args)
        else:
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
    llama_base = next((r for r in results if r["mode"] == "llama-off"), base)
    for r in results:
        llama = r["mode"] in LLAMA_MODES
        for name in ("grounded", "chat"):
            # "vs off": each engine against itself without speculation.
            w, b = r[name], (llama_base if llama else base)[name]
            same = (
                "-"
                if llama
                else [x["token_ids"] for x in w["rows"]] == [x["token_ids"] for x in b["rows"]]
            )
            rate = f"{w['accepted']}/{w['proposed']}" if w.get("proposed") else "-"
            mal = f"{w['mean_accepted_length']:.2f}" if w.get("mean_accepted_length") else "-"
            print(
                f"| {r['mode']} | {name} | {w['decode_tok_s']:.1f} | {w['median_tok_s']:.1f} | "
                f"{w['decode_tok_s'] / b['decode_tok_s']:.2f}x | {rate} | {mal} | {same} |"
            )
        if llama:
            continue
        bb = r["batch"]
        same = bb["token_ids"] == base["batch"]["token_ids"]
        print(
            f"| {r['mode']} | batch {bb['requests']} x {args.batch_len} | {bb['tok_s']:.1f} | - | "
            f"{bb['tok_s'] / base['batch']['tok_s']:.2f}x | - | - | {same} |"
        )
    print("load average before each mode:", {r["mode"]: r["load_before"] for r in results})
    if dots:
        for name in ("lm_head", "mlp_up"):
            d = dots[name]
            row = ", ".join(f"M={m}: {d[str(m)] * 1e3:.2f} ms" for m in (1, 2, 4, 8))
            print(f"XLA:CPU dot (M x {d['shape'][0]}) @ {d['shape']}: {row}")
    for r in results:
        if r.get("policy_step_s"):
            steps = ", ".join(f"{b}: {t * 1e3:.1f}" for b, t in r["policy_step_s"].items())
            print(f"{r['mode']}: step ms by token bucket {{{steps}}}", end="")
            rounds = ", ".join(f"{b}: {t * 1e3:.1f}" for b, t in r["draft_round_s"].items())
            print(f"; draft round ms by requests {{{rounds}}}" if rounds else "")
    if args.out:
        if dots:
            results.append({"mode": "dot", **dots})
        for r in results:
            if r["mode"] == "dot":
                continue
            for name in ("grounded", "chat"):
                for row in r[name]["rows"]:
                    row.pop("token_ids", None)
            if "batch" in r:
                r["batch"].pop("token_ids")
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
