"""The GPU machine's prepared script (benchmarks/gpu/device_check.sh) in its CPU dry run, so
that it cannot rot between the rare runs on a GPU: every phase runs to the end on a small
llama of Llama-3.1-8B's vocabulary, and its figures are well-formed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_device_check_dry_run_runs_every_phase(tmp_path):
    # The phases' limits are sized for the GPU's budget; beside the rest of the suite on
    # 2 cores the dry run's phases take longer.
    limits = " ".join(f"{p}=600" for p in ("env", "bandwidth", "xlm", "decode", "torch", "kernel"))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHON": sys.executable,
        "DEVICE_CHECK_LIMITS": limits,
    }
    subprocess.run(
        ["bash", "benchmarks/gpu/device_check.sh", str(tmp_path), "tiny"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=600,
        capture_output=True,
    )
    records = [json.loads(line) for line in (tmp_path / "device_check.jsonl").open()]
    status = {r["phase"]: r["rc"] for r in records if "rc" in r}
    logs = {p: (tmp_path / f"{p}.log").read_text()[-2000:] for p in status if status[p]}
    phases = ["env", "bandwidth", "xlm", "decode", "torch", "kernel"]
    assert status == dict.fromkeys(phases, 0), logs
    xlm = {
        (r["what"], r.get("requests")): r for r in records if r["phase"] == "xlm" and "rc" not in r
    }
    # Timed runs compile nothing: each workload's warm-up made its programs ready.
    timed = [r for r in xlm.values() if "compilations_timed" in r]
    assert len(timed) == 4 and all(r["compilations_timed"] == 0 for r in timed)
    assert {("concurrent", 4), ("concurrent", 8), ("anatomy", 1), ("anatomy", 4)} <= set(xlm)
    # Decode steps are those in which every request decodes: the anatomy finds 32 of them.
    assert all(xlm[("anatomy", n)]["decode_steps"] == 32 for n in (1, 4, 8))
    assert all(xlm[("concurrent", n)]["decode_steps"] > 0 for n in (4, 8))
    # The one-request decode again under an XLA_FLAGS variant, in its own process.
    decode = [r for r in records if r["phase"] == "decode" and "rc" not in r]
    assert decode[0]["xla_flags"] and {r["what"] for r in decode} >= {"one_request_decode"}
    assert all(r["tok_per_s"] > 0 for r in records if "tok_per_s" in r)
    torch = {r["what"] for r in records if r["phase"] == "torch" and "rc" not in r}
    assert torch == {"copy_bandwidth", "one_request_decode", "concurrent", "ttft"}
    # Both Pallas GPU kernels (interpret mode here) agree with the plain-jnp reference.
    kernels = [r for r in records if r["phase"] == "kernel" and "rc" not in r]
    assert {r["kernel"] for r in kernels} == {"reference_jnp", "pallas_triton", "pallas_mosaic_gpu"}
    assert all(r["max_abs_difference_to_reference"] < 2e-2 for r in kernels), kernels
    assert any("knobs" in r for r in kernels)  # the Triton kernel's knobs swept
