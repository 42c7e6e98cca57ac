"""XLM_TARGET_PLATFORM makes JAX itself run on the forced platform's backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHECK = """
import json, jax, jax.numpy as jnp
import xlm.platforms
platform = xlm.platforms.current_platform
x = jnp.ones(3) + 1
print(json.dumps({
    "platform": platform.device_name,
    "jax_platforms": jax.config.jax_platforms,
    "array_on": sorted(d.platform for d in x.devices()),
    "default_backend": jax.default_backend(),
}))
"""


def test_forced_cpu_platform_pins_jax_to_cpu():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    env["XLM_TARGET_PLATFORM"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["platform"] == "cpu"
    # JAX was told to use only the CPU backend (on a GPU/TPU host it would pick those).
    assert result["jax_platforms"] == "cpu"
    assert result["array_on"] == ["cpu"] and result["default_backend"] == "cpu"


def test_detected_cpu_platform_starts_only_jax_cpu_backend():
    """With no accelerator present, JAX starts no other installed backend (libtpu's start
    on a host without a TPU logs errors to stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    env.pop("XLM_TARGET_PLATFORM", None)
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["platform"] != "cpu":
        pytest.skip(f"this host has an accelerator ({result['platform']})")
    assert result["jax_platforms"] == "cpu"
    assert result["array_on"] == ["cpu"]
    assert "E0000" not in out.stderr and "TPU_WORKER_HOSTNAMES" not in out.stderr, out.stderr
