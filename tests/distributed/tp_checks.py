"""Tensor-parallel checks run in ONE subprocess with eight fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.distributed.tp_checks \
        OUT.json [pallas] ARCH=DIR:TP,TP[@ADAPTER_DIR,ADAPTER_DIR][#QUANTIZATION] ...

`pallas`: also compare the Pallas attention kernel per head shard with one device's.

With adapter directories the engine serves LoRA (2 slots) and the prompts alternate
between the base model and the adapters; with a quantization the weights are quantized
as loaded (xlm.quantization).

For each model directory and tensor-parallel size it records (as JSON, asserted by the
pytest side against the TP=1 run): greedy tokens and their logprobs from a whole engine
on a batch that chunks prefills and preempts, per-device weight and KV cache bytes, and
the compile counter after warm-up and after generation.
"""

from __future__ import annotations

import json
import sys

import numpy as np

# A batch that chunks prefills (16-token budget) and preempts (too few KV blocks).
ENGINE = dict(
    max_model_len=48,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    num_gpu_blocks_override=14,
    block_size=4,
    token_buckets=[16],
    enable_compilation_cache=False,
    startup_programs="all",  # the compile count after warm-up must be exact
)
MAX_TOKENS = 10


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab_size, 5 + 7 * i).tolist() for i in range(4)]


def sharded_bytes(tree) -> tuple[int, int]:
    """(bytes of arrays split over `model`, bytes of replicated arrays), whole sizes."""
    import jax

    split = whole = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if "model" in tuple(leaf.sharding.spec):
            split += leaf.nbytes
        else:
            whole += leaf.nbytes
    return split, whole


def num_kv_cache_groups(model: str) -> int:
    """How many KV cache groups xlm makes for this checkpoint's layer windows."""
    from xlm.core.kv_cache_groups import group_layers
    from xlm.models.llama import layer_sliding_window
    from xlm.models.loader import load_hf_config

    config = load_hf_config(model)
    windows = [layer_sliding_window(config, i) for i in range(config.num_hidden_layers)]
    return len(group_layers(windows))


def run(
    model: str, tp: int, engine: dict, adapters: list[str] = (), quantization: str | None = None
) -> dict:
    import xlm
    from xlm.distributed.mesh import per_device_bytes

    engine = dict(engine)
    loras = [None]
    if adapters:
        engine.update(enable_lora=True, max_loras=2, max_lora_rank=8)
        loras += [xlm.LoRARequest(f"a{i}", i, d) for i, d in enumerate(adapters, 1)]
    # A model with several KV cache groups (windowed and full layers) needs a block in
    # each group per token span: the same pool, in blocks, for each group.
    engine["num_gpu_blocks_override"] *= num_kv_cache_groups(model)
    llm = xlm.LLM(model=model, tensor_parallel_size=tp, quantization=quantization, **engine)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.executor.worker.model_runner
    compiles_after_warmup = core.get_num_compilations()
    vocab = runner.vocab_size
    params = xlm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1)
    batch = prompts(vocab)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        params,
        lora_request=[loras[i % len(loras)] for i in range(len(batch))],
    )
    result = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            for o in outs
        ],
        "num_preemptions": core.scheduler.num_preemptions,
        "compiles_after_warmup": compiles_after_warmup,
        "compiles_after_generate": core.get_num_compilations(),
    }
    if tp > 1:
        weights = per_device_bytes(runner.state)
        kv = per_device_bytes(runner.kv_caches)
        result["weight_bytes_per_device"] = sorted(set(weights.values()))
        result["kv_bytes_per_device"] = sorted(set(kv.values()))
        result["num_devices"] = len(weights)
        result["weights_split_whole"] = sharded_bytes(runner.state)
        result["kv_split_whole"] = sharded_bytes(runner.kv_caches)
        if adapters:  # each B of a column-parallel projection is split like its kernel
            q_b = runner.state["model"]["layers"][0]["self_attn"]["q_proj"]["lora_b"]
            result["lora_q_b_bytes_per_device"] = sorted(
                set(per_device_bytes(q_b.get_value()).values())
            )
            result["lora_q_b_bytes"] = q_b.get_value().nbytes
        if quantization:  # the kernel and its scales split over the same columns (q) or
            # rows and groups (down); minimums where the scheme has them
            layer = runner.state["model"]["layers"][0]
            for name, proj in (
                ("q", layer["self_attn"]["q_proj"]),
                ("down", layer["mlp"]["down_proj"]),
            ):
                for leaf in ("kernel", "weight_scale", "weight_min"):
                    if leaf not in proj:
                        continue
                    value = proj[leaf].get_value()
                    result[f"{name}_{leaf}_bytes"] = value.nbytes
                    result[f"{name}_{leaf}_bytes_per_device"] = sorted(
                        set(per_device_bytes(value).values())
                    )
    llm.llm_engine.engine_core.shutdown()
    return result


def pallas_per_shard(tp: int) -> float:
    """Max |difference| of the Pallas GPU kernel (interpret mode) run per head shard under
    a tp-way mesh (the op's shard_map) against the same kernel on one device."""
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_gpu, write_kv
    from tests.pallas_kernels.rpa_batches import make_batch
    from xlm.config import ParallelConfig
    from xlm.distributed.mesh import make_mesh
    from xlm.ops.paged_attention import AttentionMetadata, PagedAttention

    hq, hkv, d, bs = 8, 4, 32, 8
    b = make_batch(
        np.random.default_rng(0),
        [5, 1, 9],
        [5, 12, 20],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        num_tokens=16,
        num_reqs=4,
    )
    rng = np.random.default_rng(1)
    t = b.q.shape[0]
    k = rng.standard_normal((t, hkv, d), np.float32)
    v = rng.standard_normal((t, hkv, d), np.float32)
    slots = np.zeros(t, np.int32)  # this step's K/V go to the null block
    md = AttentionMetadata(
        positions=np.zeros(t, np.int32),
        slot_mapping=slots,
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        block_tables=b.block_tables,
        num_seqs=b.num_seqs,
    )
    op = PagedAttention(hq, hkv, d, d**-0.5)
    kernel = functools.partial(ragged_paged_attention_gpu, interpret=True)

    def run(q, k, v, cache, md):
        return op._run_kernel(kernel, write_kv, q, k, v, cache, md)[0]

    expect = np.asarray(jax.jit(run)(b.q, k, v, b.kv_cache, md))
    mesh = make_mesh(ParallelConfig(tensor_parallel_size=tp))
    heads = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model", None))
    cache = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*op.kv_cache_sharding()))
    args = (
        jax.device_put(b.q, heads),
        jax.device_put(k, heads),
        jax.device_put(v, heads),
        jax.device_put(jnp.asarray(b.kv_cache), cache),
        md,
    )
    with jax.set_mesh(mesh):
        got = jax.jit(run)(*args)
        assert "shard_map" in str(jax.make_jaxpr(run)(*args)), "the kernel ran without shard_map"
    assert len(got.sharding.device_set) == tp
    return float(np.max(np.abs(np.asarray(got) - expect)))


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    engine = dict(ENGINE)
    results: dict[str, dict[str, dict]] = {}
    if "pallas" in specs:
        specs.remove("pallas")
        results["pallas_per_shard"] = {"4": pallas_per_shard(4)}
    for spec in specs:
        name, _, rest = spec.partition("=")
        rest, _, quantization = rest.partition("#")
        rest, _, adapters = rest.partition("@")
        model, _, tps = rest.rpartition(":")
        results[name] = {}
        for tp in [int(t) for t in tps.split(",")]:
            results[name][str(tp)] = run(
                model, tp, engine, adapters.split(",") if adapters else [], quantization or None
            )
            print(name, tp, results[name][str(tp)]["tokens"][0], flush=True)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
