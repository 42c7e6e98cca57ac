"""Tensor parallelism on fake CPU devices: per-device bytes and collectives per layer.

A Llama-shaped model (hidden 1024, 16 query / 4 KV heads of 64, MLP 4096, vocab 32000,
4 layers, float32 dummy weights) is built at TP=1, 2, 4 and 8 on eight fake CPU devices
(TP=8 replicates each KV head twice). For each: the bytes of weights and KV cache one
device holds, and the collectives in the compiled model step (its optimized HLO) per
decoder layer. Fake devices share one CPU: nothing here is a speed figure.

    python benchmarks/tensor_parallel.py     # table + benchmarks/tensor_parallel.json
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLM_DISABLE_PROGRESS_BARS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

LAYERS = 4
CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=LAYERS,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def measure(model_dir: str, tp: int) -> dict:
    from xlm.config import (
        CacheConfig,
        CompilationConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        XlmConfig,
    )
    from xlm.distributed.mesh import per_device_bytes
    from xlm.worker.compilation import ProgramKind
    from xlm.worker.worker import Worker

    config = XlmConfig(
        ModelConfig(model=model_dir, load_format="dummy", dtype="float32", max_model_len=2048),
        cache_config=CacheConfig(block_size=16, num_blocks=1024),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=64, max_model_len=2048
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        compilation_config=CompilationConfig(
            token_buckets=[64], startup_programs="used", enable_compilation_cache=False
        ),
    )
    worker = Worker(config)
    runner = worker.model_runner
    spec = runner.program_specs()[runner._key(ProgramKind.MODEL, 64)]
    hlo = spec.lower().compile().as_text()
    counts = {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo)) for op in COLLECTIVES}
    weights = max(per_device_bytes(runner.state).values())
    kv = max(per_device_bytes(runner.kv_caches).values())
    return {
        "tp": tp,
        "weight_bytes_per_device": weights,
        "kv_bytes_per_device": kv,
        "collectives_in_step": counts,
        "collectives_per_layer": sum(counts.values()) / LAYERS,
    }


def main() -> None:
    from transformers import LlamaConfig

    with tempfile.TemporaryDirectory() as model_dir:
        LlamaConfig(**CONFIG).save_pretrained(model_dir)
        rows = [measure(model_dir, tp) for tp in (1, 2, 4, 8)]
    print(f"{'TP':>3}{'weights MiB/dev':>17}{'KV MiB/dev':>12}  collectives in the step")
    for r in rows:
        ops = ", ".join(f"{k} {v}" for k, v in r["collectives_in_step"].items() if v)
        print(
            f"{r['tp']:>3}{r['weight_bytes_per_device'] / 2**20:>17.1f}"
            f"{r['kv_bytes_per_device'] / 2**20:>12.1f}  {ops or 'none'}"
            f" ({r['collectives_per_layer']:.2f} per layer)"
        )
    out = {"config": CONFIG, "kv_blocks": 1024, "block_size": 16, "rows": rows}
    (HERE / "tensor_parallel.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
