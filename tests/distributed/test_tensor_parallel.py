"""Tensor parallelism on eight fake CPU devices (one subprocess): every tiny architecture
generates the same greedy tokens at TP=4 (TP=8 with KV-head replication where the heads
allow) as at TP=1, on a batch that chunks prefills and preempts; SmolLM2-135M
at TP=3 equals TP=1; each device holds 1/tp of the split weights and KV cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import fake_devices_env, write_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# TP=4 splits every dimension TP=2 does (twice as finely); a 2-way mesh is also checked at
# the model level in tests/models/test_sharding.py, so the engine runs TP=1 and TP=4 only.
# The plain Llama runs at TP=8 ("llama_8heads" below): its TP=4 paths (two KV heads each
# replicated 2x, an untied lm_head) are mistral's, which adds a sliding window.
TINY_TPS = {
    "llama3": [1, 4],  # one KV head: replicated 4x
    "mistral": [1, 4],
    "qwen2": [1, 4],
    "qwen3": [1, 4],
    "qwen3_moe": [1, 4],
}


def run_checks(tmp_path, specs: list[str], timeout: int = 1500) -> dict:
    env = fake_devices_env(8)
    env.update(JAX_PLATFORMS="cpu", XLM_LOGGING_LEVEL="WARNING")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.tp_checks", str(out), *specs],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def assert_equal_to_tp1(name: str, runs: dict, atol: float = 1e-4) -> None:
    ref = runs["1"]
    assert ref["num_preemptions"] > 0, f"{name}: the batch never preempted"
    for tp, run in runs.items():
        assert run["tokens"] == ref["tokens"], f"{name} TP={tp} tokens differ from TP=1"
        for got, want in zip(run["logprobs"], ref["logprobs"], strict=True):
            np.testing.assert_allclose(got, want, atol=atol, err_msg=f"{name} TP={tp}")
        assert run["compiles_after_generate"] == run["compiles_after_warmup"], (
            f"{name} TP={tp} compiled after warm-up"
        )
        if tp == "1":
            continue
        tp_size = int(tp)
        assert run["num_devices"] == tp_size
        split, whole = run["weights_split_whole"]
        assert split > 10 * whole, f"{name}: most weights must be split"
        # One value: every device holds the same bytes, 1/tp of the split weights.
        assert run["weight_bytes_per_device"] == [split // tp_size + whole], name
        kv_split, kv_whole = run["kv_split_whole"]
        assert kv_whole == 0 and run["kv_bytes_per_device"] == [kv_split // tp_size], name


@pytest.mark.slow
def test_tiny_architectures_equal_tp1_on_eight_devices(tmp_path, tiny_checkpoint):
    # 8 query heads, 2 KV heads: TP=8 replicates each KV head 4 times.
    wide = write_tiny_checkpoint(
        "llama", str(tmp_path / "llama_8h"), num_attention_heads=8, num_key_value_heads=2
    )
    specs = [f"{a}={tiny_checkpoint(a)}:{','.join(map(str, t))}" for a, t in TINY_TPS.items()]
    results = run_checks(tmp_path, ["pallas", *specs, f"llama_8heads={wide}:1,8"])
    assert results.pop("pallas_per_shard")["4"] < 1e-5
    assert set(results) == {*TINY_TPS, "llama_8heads"}
    for name, runs in results.items():
        assert_equal_to_tp1(name, runs)


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(tmp_path, smollm2_gguf):
    # 9 query heads, 3 KV heads, 1536 MLP columns, 49152 vocabulary rows: all split by 3.
    results = run_checks(tmp_path, [f"smollm2={smollm2_gguf}:1,3"])
    assert_equal_to_tp1("smollm2", results["smollm2"])
