"""Tensor parallelism from the parameters' sharding metadata: same logits on a 2-way mesh."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tests.conftest import fake_devices_env

SCRIPT = """
import sys
import jax
import numpy as np

from tests.conftest import fake_devices_env
from jax.sharding import AxisType
from tests.models.logits_check import run_schedule
from xlm.config import ModelConfig, XlmConfig
from xlm.models.loader import get_model
from tests.conftest import fake_devices_env

model_dir, out = sys.argv[1], sys.argv[2]
mesh = jax.make_mesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
rng = np.random.default_rng(0)
ids = {r: rng.integers(0, 256, 20).tolist() for r in "ABC"}
results = {}
for name, m in [("plain", None), ("tp2", mesh)]:
    model = get_model(XlmConfig(ModelConfig(model=model_dir)), mesh=m)
    if m is not None:
        kernel = model.model.layers[0].self_attn.qkv_proj.kernel[...]
        assert len(kernel.sharding.device_set) == 2, kernel.sharding
        with jax.set_mesh(m):
            logits = run_schedule(model, ids, seed=0, mesh=m)
        assert len(model.make_kv_caches(4, 4, np.float32, mesh=m)[0].sharding.device_set) == 2
    else:
        logits = run_schedule(model, ids, seed=0)
    results[name] = np.concatenate(list(logits.values()))
np.savez(out, **results)
"""


def test_tensor_parallel_logits_equal_single_device(tmp_path, tiny_checkpoint):
    env = fake_devices_env(2)
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = str(tmp_path / "logits.npz")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_checkpoint("qwen3"), out],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = np.load(out)
    np.testing.assert_allclose(res["tp2"], res["plain"], rtol=1e-5, atol=1e-5)
