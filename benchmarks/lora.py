"""Multi-LoRA throughput and memory: a batch of 64 under 4 adapters mixed vs the base model.

Each mode runs in its own process (`--one MODE` is that process) on the built-in model's
float32 weights (the HF directory benchmarks/peers.py makes), every program compiled
before anything is timed, one untimed warm-up pass, then `--repeats` timed passes:

- `base`: the engine without LoRA, every request on the base model.
- `lora-base`: an engine with `--max-loras 4 --max-lora-rank 16`, every request on the
  base model (what the adapter slots cost when no request uses them).
- `lora-1`: the same engine, every request under one adapter.
- `lora-4`: the same engine, requests round-robin over 4 adapters (and none on the base).

The adapters are written by `peft` (rank 16 on q/k/v/o/gate/up/down, random A and B at
a scale that changes the text but keeps it text) under `--work-dir`. The workload is
benchmarks/peers.py's: 64 passages of peers_prompts.txt cut to 16-64 tokens, 128 tokens
each, greedy, EOS ignored. Reported: output tok/s (median pass), the device bytes of the
weights with the adapter slots, the bytes of one slot, and the process's peak RSS.

`ops` (its own process too) times one projection of each SmolLM2 shape at 64 tokens,
alone and with the adapter product done four ways: the `lora` op (dense over all slots,
per part for gate | up), the dense product without the per-part split, a gather of each
token's B, and `lax.ragged_dot` over tokens grouped by slot.

    python benchmarks/lora.py [--modes base,lora-base,lora-1,lora-4] \
        [--out benchmarks/lora.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODES = ("base", "lora-base", "lora-1", "lora-4", "ops")
NUM_ADAPTERS = 4
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(hf_dir: str, work_dir: Path) -> list[str]:
    """NUM_ADAPTERS PEFT adapters over the model (made once)."""
    paths = [work_dir / f"lora-r{RANK}-{i}" for i in range(NUM_ADAPTERS)]
    if all((p / "adapter_model.safetensors").exists() for p in paths):
        return [str(p) for p in paths]
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, path in enumerate(paths):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        config = LoraConfig(
            r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False
        )
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.05)
        model.save_pretrained(str(path))
    return [str(p) for p in paths]


def run_one(mode: str, args: argparse.Namespace) -> dict:
    import jax

    import xlm
    from benchmarks.peers import load_prompts
    from xlm.distributed.mesh import per_device_bytes

    lora = mode != "base"
    engine = dict(max_model_len=1024, startup_programs="all", max_num_seqs=args.batch)
    if lora:
        engine.update(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
    start = time.perf_counter()
    llm = xlm.LLM(model=args.hf_dir, **engine)
    load_s = time.perf_counter() - start
    loras = [xlm.LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(args.adapters)]
    per_request = {
        "base": [None],
        "lora-base": [None],
        "lora-1": loras[:1],
        "lora-4": loras,
    }[mode]
    prompts = load_prompts(llm.get_tokenizer(), args.batch, seed=0)
    chosen = [per_request[i % len(per_request)] for i in range(len(prompts))]
    params = xlm.SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, params, use_tqdm=False, lora_request=chosen)  # warm-up
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    compiled = runner.num_compilations
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False, lora_request=chosen)
        times.append(time.perf_counter() - t)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    weights = per_device_bytes(runner.state)
    lora_leaves = [
        v.get_value()
        for path, v in jax.tree_util.tree_leaves_with_path(
            runner.state, is_leaf=lambda x: hasattr(x, "get_value")
        )
        if "lora_" in jax.tree_util.keystr(path)
    ]
    return {
        "mode": mode,
        "load_s": load_s,
        "requests": len(prompts),
        "tokens": tokens,
        "seconds": times,
        "tok_s": tokens / statistics.median(times),
        "compiles_while_timed": runner.num_compilations - compiled,
        "weight_bytes": max(weights.values()),
        "lora_slot_arrays_bytes": sum(x.nbytes for x in lora_leaves),
        "slot_bytes": runner.lora.spec.slot_bytes(4) if runner.lora is not None else 0,
        "slot_writes": runner.lora.num_slot_writes if runner.lora is not None else 0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def op_variants(tokens: int = 64, repeats: int = 200) -> dict:
    """Median ms of x @ W alone and with each way of adding the adapters' product."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from xlm.ops.lora import LoRA

    def timed(fns: dict, *args) -> dict:
        """Median ms of each function, the functions interleaved call by call (so a slow
        spell of the machine hits them all alike)."""
        for fn in fns.values():
            for _ in range(5):
                fn(*args[: fn.nargs]).block_until_ready()
        times = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn(*args[: fn.nargs]).block_until_ready()
                times[name].append(time.perf_counter() - t)
        return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}

    def jitted(fn, nargs: int = 5):
        f = jax.jit(fn)
        f.nargs = nargs
        return f

    rng = np.random.default_rng(0)
    n = NUM_ADAPTERS
    shapes = {
        "q": (576, 576, 1),
        "k": (576, 192, 1),
        "gate_up": (576, 3072, 2),
        "down": (1536, 576, 1),
    }

    def one_shape(d_in: int, d_out: int, parts: int) -> dict:
        rank = RANK * parts
        x = jnp.asarray(rng.standard_normal((tokens, d_in)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((d_in, d_out)), jnp.float32)
        a = jnp.asarray(rng.standard_normal((d_in, n, rank)), jnp.float32)
        logical = np.zeros((n, rank, d_out), np.float32)
        for p in range(parts):
            cols = slice(p * d_out // parts, (p + 1) * d_out // parts)
            logical[:, p * RANK : (p + 1) * RANK, cols] = rng.standard_normal(
                (n, RANK, d_out // parts)
            )
        b = jnp.asarray(logical)
        # Grouped by slot, as ragged_dot needs (the mix is the same for every variant).
        slots = jnp.asarray(np.repeat(np.arange(1, n + 1), tokens // n), jnp.int32)
        sizes = jnp.full((n,), tokens // n, jnp.int32)
        op, dense = LoRA(parts), LoRA(1)

        def gathered(x, w, a, b, s):
            xa = (x @ a.reshape(d_in, -1)).reshape(tokens, n, rank)
            own = jnp.take_along_axis(xa, (s - 1)[:, None, None], axis=1)[:, 0]
            return x @ w + jnp.einsum("tr,tro->to", own, b[s - 1])

        def ragged(x, w, a, b, s):
            xa = (x @ a.reshape(d_in, -1)).reshape(tokens, n, rank)
            own = jnp.take_along_axis(xa, (s - 1)[:, None, None], axis=1)[:, 0]
            return x @ w + jax.lax.ragged_dot(own, b, sizes)

        variants = {
            "alone": jitted(lambda x, w: x @ w, 2),
            "lora_op": jitted(lambda *v: v[0] @ v[1] + op(v[0], *v[2:])),
            "dense_all_columns": jitted(lambda *v: v[0] @ v[1] + dense(v[0], *v[2:])),
            "gather_b": jitted(gathered),
            "ragged_dot": jitted(ragged),
        }
        return timed(variants, x, w, a, b, slots)

    return {name: one_shape(*shape) for name, shape in shapes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default="/tmp/xlm-peers")
    parser.add_argument("--out", default=str(HERE / "lora.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--adapters", type=lambda s: s.split(","), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(op_variants() if args.one == "ops" else run_one(args.one, args)))
        return
    from benchmarks.common import cpu_model
    from benchmarks.peers import prepare_weights

    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = prepare_weights(args.model, work_dir)["hf_dir"]
    adapters = write_adapters(hf_dir, work_dir)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_before": os.getloadavg(),
        "model": args.model,
        "adapters": {"count": NUM_ADAPTERS, "rank": RANK, "targets": TARGETS},
        "modes": {},
    }
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--one", mode, "--hf-dir", hf_dir]
        cmd += ["--adapters", ",".join(adapters), "--batch", str(args.batch)]
        cmd += ["--output-len", str(args.output_len), "--repeats", str(args.repeats)]
        env = dict(os.environ, XLM_DISABLE_PROGRESS_BARS="1", XLM_LOGGING_LEVEL="WARNING")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-4000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        report["modes"][mode] = result
        if mode == "ops":
            for name, row in result.items():
                print(f"{name:8s} " + "  ".join(f"{k} {v:.3f} ms" for k, v in row.items()))
            continue
        print(
            f"{mode:10s} {result['tok_s']:7.1f} tok/s  weights {result['weight_bytes'] / 2**20:.0f}"
            f" MiB  slots {result['lora_slot_arrays_bytes'] / 2**20:.1f} MiB  peak RSS "
            f"{result['peak_rss_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
    report["load_after"] = os.getloadavg()
    base = report["modes"].get("base")
    if base is not None:
        for name, result in report["modes"].items():
            if name == "ops":
                continue
            result["vs_base"] = result["tok_s"] / base["tok_s"]
            if name == "lora-base":  # no adapter in any request: the base model's tokens
                result["tokens_equal_base"] = result["token_ids"] == base["token_ids"]
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
