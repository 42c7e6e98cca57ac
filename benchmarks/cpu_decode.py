"""The decode step on CPU, one request or a batch: the float kernel against XLA's dot,
float32 and half weights, in one process, against each variant's weight-streaming floor.

    python benchmarks/cpu_decode.py [--variants float32,float32-xla,bfloat16,float16]
        [--batch 1] [--output-len 64] [--repeats 5] [--out benchmarks/cpu_decode.json]

Variants (built-in SmolLM2-135M GGUF, dequantized):
- `float32`: float32 weights, the default: projections stored [out, in], through
  xlm.ops.cpu_kernels.float_matmul at 1-8 rows, XLA's dot on [out, in] above;
- `bfloat16`, `float16`: `--dtype` half on CPU: half projections and embeddings widened in
  the kernel, float32 activations (the default for those dtypes);
- `<dtype>-xla`: the float_matmul op off (custom_ops -float_matmul): kernels [in, out]
  and XLA's dot (half weights: XLA's convert + dot), the paths before the kernel
  (`float32-xla` is also `FloatMatmul.float32_kernel` off);
- any `xlm.LLM` quantization (`int8`, `w8a8`, ...) as a variant name.
Every engine is built first (all programs compiled), then the variants take turns,
`--repeats` rounds: decode tok/s = B (L - 1) / (T(L) - T(1)) of B = `--batch` real-text
prompts generated together, L = `--output-len` (a batch of 64 is the peers' batch row:
half weights take the kernel's packed tiles there, `bfloat16-xla` XLA's convert + dot).
Step ms (per step of B tokens) against the floor = the engine's weight bytes over the copy
bandwidth measured in the same run (read + write of 1 GiB; a read-only stream gets more,
so a step can beat it). Greedy agreement with the first variant: matching prefix.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import XlmRunner, measure_bandwidth, time_call  # noqa: E402

sys.path.pop(0)

QUANTIZATIONS = ("int8", "w8a8", "fp8", "gguf", "int4")


def build(variant: str, model: str, batch: int, output_len: int) -> XlmRunner:
    """An engine for `variant`, every program compiled before it returns."""
    args: dict = dict(
        max_model_len=512,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=max(64, batch * ((64 + output_len) // 16 + 2)),
        enable_prefix_caching=False,
    )
    name = variant.removesuffix("-xla")
    if name in QUANTIZATIONS:
        args["quantization"] = name
    else:
        args["dtype"] = name
    if variant.endswith("-xla"):
        args["custom_ops"] = ["-float_matmul"]
    return XlmRunner(model, max_num_seqs=max(8, batch), **args)


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="float32,float32-xla,bfloat16,float16")
    parser.add_argument("--batch", type=int, default=1, help="requests decoded together")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "cpu_decode.json"))
    args = parser.parse_args()
    variants = args.variants.split(",")

    runners = {v: build(v, args.model, args.batch, args.output_len) for v in variants}
    sys.path.insert(0, str(HERE))
    import peers  # noqa: E402  (the peers' real-text prompts)

    sys.path.pop(0)
    first = runners[variants[0]]
    prompts = peers.load_prompts(first.llm.get_tokenizer(), args.batch, seed=0)
    prompt = prompts[0]
    outputs = {v: r.generate(prompts, args.output_len)[0] for v, r in runners.items()}
    bandwidth = measure_bandwidth()
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):  # the variants take turns: the same minute for each
        for v, r in runners.items():
            t1, _ = time_call(r.generate, prompts, 1)
            tl, _ = time_call(r.generate, prompts, args.output_len)
            rates[v].append(args.batch * (args.output_len - 1) / (tl - t1))
    rows = []
    for v, r in runners.items():
        tok_s = statistics.median(rates[v])
        floor_ms = 1e3 * r.weight_bytes / bandwidth
        rows.append(
            {
                "variant": v,
                "decode_tok_s": tok_s,
                "decode_tok_s_all": rates[v],
                "step_ms": 1e3 * args.batch / tok_s,
                "weight_bytes": r.weight_bytes,
                "floor_ms": floor_ms,
                "matching_prefix": matching_prefix(outputs[v], outputs[variants[0]]),
            }
        )
    base = rows[0]["decode_tok_s"]
    print(
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {args.batch} request(s), first prompt "
        f"{len(prompt)} tokens, {args.output_len} new, {args.repeats} rounds\n"
    )
    print(
        f"| variant | decode tok/s | step ms | vs {variants[0]} | weights MB | floor ms "
        f"| step / floor | greedy prefix = {variants[0]} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['decode_tok_s']:.1f} | {row['step_ms']:.1f} | "
            f"{row['decode_tok_s'] / base:.2f}x | {row['weight_bytes'] / 1e6:.0f} | "
            f"{row['floor_ms']:.1f} | {row['step_ms'] / row['floor_ms']:.2f} | "
            f"{row['matching_prefix']}/{args.output_len} |"
        )
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "bandwidth_GBps": bandwidth / 1e9,
        "batch": args.batch,
        "output_len": args.output_len,
        "prompt_tokens": len(prompt),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
