"""The host KV tier end to end on a tiny model: a device pool far smaller than 32 long-prefix
requests, two passes over them. The second pass loads every block it can from the host
(recomputing only the last token of each prompt), its greedy tokens and logprobs equal the
first pass's (computed with no cache hit at all) and a tier-less engine's, the host memory
stays within kv_offloading_size, and no copy compiles after warm-up. The same at TP=2 on
fake CPU devices (each device's shard on the host), with an int8 KV cache, and for Gemma 3's
two KV cache groups (sliding-window and full-attention layers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import fake_devices_env
from tests.engine.reference import TINY_ENGINE, tiny_engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 1 << 30
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 32, 100, 4
FULL = (PROMPT_LEN - 1) // TINY_ENGINE["block_size"] * TINY_ENGINE["block_size"]


def long_prefix_prompts() -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"prompt_token_ids": rng.integers(6, 200, size=PROMPT_LEN).tolist()}
        for _ in range(NUM_PROMPTS)
    ]


def run_two_passes(path: str, **engine) -> dict:
    """Both passes' (the second in reverse order) tokens, logprobs, cached and scheduled
    tokens, and the tier's counters (JSON-able: the TP run returns it from a subprocess)."""
    import xlm

    llm = xlm.LLM(model=path, **dict(TINY_ENGINE, **engine))
    core = llm.llm_engine.engine_core.engine_core
    compiles = core.get_num_compilations()
    sp = xlm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    passes = []
    for order in (1, -1):
        # The second pass in reverse: the blocks saved last come first, which an LRU host
        # tier smaller than the working set still holds.
        before = llm.get_stats().total_num_scheduled_tokens
        outs = llm.generate(long_prefix_prompts()[::order], sp, use_tqdm=False)[::order]
        passes.append(
            dict(
                tokens=[o.outputs[0].token_ids for o in outs],
                logprobs=[
                    [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                    for o in outs
                ],
                cached=[o.num_cached_tokens for o in outs],
                scheduled=llm.get_stats().total_num_scheduled_tokens - before,
            )
        )
    stats = llm.get_stats()
    runner = core.executor.worker.model_runner
    tier = core.scheduler.host_kv_tier
    host = runner.host_kv
    return dict(
        passes=passes,
        host_hits=stats.host_kv_cache_hits,
        bytes_to_host=stats.host_kv_bytes_to_host,
        bytes_to_device=stats.host_kv_bytes_to_device,
        used_slots=tier.num_used_slots,
        num_slots=tier.num_slots,
        host_nbytes=host.nbytes,
        shards_per_array=[len(b) for b in host._buffers],
        shard_shapes=[[list(x.shape) for x in b.values()] for b in host._buffers],
        cache_shape=list(runner.kv_caches[0].shape),
        compiles_after_warmup=compiles,
        compiles_after_generate=core.get_num_compilations(),
    )


def check_run(run: dict, size_gib: float, all_held: bool) -> None:
    first, second = run["passes"]
    assert first["cached"] == [0] * NUM_PROMPTS  # distinct prompts: pass 1 computes all
    assert second["tokens"] == first["tokens"]
    for got, want in zip(second["logprobs"], first["logprobs"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert run["host_hits"] > 0 and run["bytes_to_device"] > 0 and run["bytes_to_host"] > 0
    assert run["used_slots"] <= run["num_slots"]
    assert run["host_nbytes"] <= size_gib * GiB
    assert run["compiles_after_generate"] == run["compiles_after_warmup"]
    if all_held:
        # The host held every block: each prompt recomputes only its last partial block,
        # and each request decodes MAX_TOKENS - 1 tokens.
        assert second["cached"] == [FULL] * NUM_PROMPTS
        want = NUM_PROMPTS * (PROMPT_LEN - FULL + MAX_TOKENS - 1)
        assert second["scheduled"] == want


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


def test_second_pass_hits_the_host_tier_and_matches_a_tierless_engine(llama):
    run = run_two_passes(llama, kv_offloading_size=0.01)
    check_run(run, 0.01, all_held=True)
    # Every full block came from a cache (check_run); the second pass starts with the
    # prompts pass 1 ended with, whose blocks the device pool may still hold: the host
    # served the rest.
    device_pool = TINY_ENGINE["num_gpu_blocks_override"] * TINY_ENGINE["block_size"]
    assert NUM_PROMPTS * FULL - device_pool <= run["host_hits"] <= NUM_PROMPTS * FULL
    import xlm

    sp = xlm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    plain = tiny_engine(llama).generate(long_prefix_prompts(), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == run["passes"][1]["tokens"]


def test_a_small_host_tier_keeps_its_cap(llama):
    """Room for fewer blocks than the working set: some hits, the cap, the same tokens."""
    size = 0.0005
    run = run_two_passes(llama, kv_offloading_size=size)
    check_run(run, size, all_held=False)
    assert run["num_slots"] < NUM_PROMPTS * FULL // TINY_ENGINE["block_size"]


def test_int8_kv_cache(llama):
    run = run_two_passes(llama, kv_offloading_size=0.01, kv_cache_dtype="int8")
    check_run(run, 0.01, all_held=True)


def test_gemma3_sliding_and_full_attention_groups(tiny_checkpoint):
    """Two KV cache groups (a sliding-window layer and a full-attention layer over one
    pool): both groups' blocks go out and come back, the tokens equal a tier-less
    engine's, and nothing is recomputed that the host holds."""
    path = tiny_checkpoint("gemma3")
    run = run_two_passes(path, kv_offloading_size=0.01)
    check_run(run, 0.01, all_held=True)
    assert run["cache_shape"][1] == TINY_ENGINE["num_gpu_blocks_override"]
    import xlm

    sp = xlm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    plain = tiny_engine(path).generate(long_prefix_prompts(), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == run["passes"][1]["tokens"]


TP_SCRIPT = """
import json, sys
from tests.worker.test_host_kv_cache import run_two_passes
run = run_two_passes(sys.argv[1], kv_offloading_size=0.01, tensor_parallel_size=2,
                     enable_compilation_cache=False)
open(sys.argv[2], "w").write(json.dumps(run))
"""


def test_tensor_parallel_keeps_each_devices_shard(llama, tmp_path):
    env = fake_devices_env(8)
    env.update(JAX_PLATFORMS="cpu", XLM_LOGGING_LEVEL="WARNING")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, llama, str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    run = json.loads(out.read_text())
    check_run(run, 0.01, all_held=True)
    # Two KV heads over two devices: each array keeps two shards of one head each.
    assert set(run["shards_per_array"]) == {2}
    heads = run["cache_shape"][3]
    assert all(shape[3] == heads // 2 for shapes in run["shard_shapes"] for shape in shapes)
