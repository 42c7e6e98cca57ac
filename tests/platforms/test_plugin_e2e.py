"""The installed example out-of-tree plugin, end to end, in fresh processes."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("xlm_oot_example", reason="pip install -e examples/oot_platform_plugin")


def run_python(code: str, env: dict | None = None, extra_path: str | None = None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("XLM_")}
    full_env.update(env or {})
    if extra_path:
        full_env["PYTHONPATH"] = os.pathsep.join(
            [extra_path, full_env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


PRINT_PLATFORM = """
import sys, xlm
p = xlm.platforms.current_platform
from jax._src import xla_bridge
print(type(p).__name__, bool(xla_bridge._backends), 'jax' in sys.modules)
"""


def test_import_resolves_cpu_without_initializing_jax():
    out = run_python(PRINT_PLATFORM)
    assert out.returncode == 0, out.stderr
    name, backends_initialized, _ = out.stdout.split()
    assert name == "CpuPlatform"
    assert backends_initialized == "False"


def test_example_platform_activates_only_when_asked():
    out = run_python(PRINT_PLATFORM, {"XLM_OOT_EXAMPLE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "ExampleOotPlatform"
    assert "oot_example (out-of-tree) is activated" in out.stderr


@pytest.mark.parametrize(
    ("plugins", "expected"),
    [
        ("", "CpuPlatform"),
        ("oot_example", "ExampleOotPlatform"),
        ("something_else", "CpuPlatform"),
        ("something_else,oot_example", "ExampleOotPlatform"),
    ],
)
def test_xlm_plugins_filters(plugins, expected):
    out = run_python(PRINT_PLATFORM, {"XLM_OOT_EXAMPLE": "1", "XLM_PLUGINS": plugins})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == expected


def test_two_activated_out_of_tree_plugins_is_an_error(tmp_path):
    # A second plugin, installed by putting its metadata on the path.
    pkg = tmp_path / "second_plugin.py"
    pkg.write_text("def detect():\n    return 'xlm.platforms.cpu.CpuPlatform'\n")
    dist = tmp_path / "second_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: second-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[xlm.platform_plugins]\nsecond = second_plugin:detect\n"
    )
    out = run_python(PRINT_PLATFORM, {"XLM_OOT_EXAMPLE": "1"}, extra_path=str(tmp_path))
    assert out.returncode != 0
    assert "RuntimeError" in out.stderr
    assert "['oot_example', 'second']" in out.stderr


def test_substituted_rms_norm_runs_forward_oot_and_matches_native():
    code = """
    import numpy as np, jax, jax.numpy as jnp
    from xlm.config import XlmConfig, ModelConfig, set_current_xlm_config
    from xlm.platforms import current_platform
    from xlm.plugins import load_general_plugins
    from xlm.ops import RMSNorm
    import xlm_oot_example.ops as example_ops
    load_general_plugins()
    load_general_plugins()  # safe to call again
    config = XlmConfig(ModelConfig(model="unused"))
    current_platform.check_and_update_config(config)
    with set_current_xlm_config(config):
        norm = RMSNorm(64, eps=1e-5)
    x = jax.random.normal(jax.random.key(0), (4, 64))
    r = jax.random.normal(jax.random.key(1), (4, 64))
    out, res = norm(x, r)
    ref_out, ref_res = norm.forward_native(x, r)
    print(type(norm).__name__, norm._forward_name, example_ops.FORWARD_OOT_CALLS,
          float(jnp.max(jnp.abs(out - ref_out))), float(jnp.max(jnp.abs(res - ref_res))))
    """
    out = run_python(code, {"XLM_OOT_EXAMPLE": "1"})
    assert out.returncode == 0, out.stderr
    cls, forward, calls, err_out, err_res = out.stdout.split()
    assert cls == "ExampleRMSNorm"
    assert forward == "forward_oot"
    assert int(calls) == 1
    assert float(err_out) < 1e-5 and float(err_res) == 0.0


def test_without_the_platform_substituted_op_stays_native():
    code = """
    from xlm.plugins import load_general_plugins
    from xlm.ops import RMSNorm
    load_general_plugins()
    norm = RMSNorm(8)
    print(type(norm).__name__, norm._forward_name)
    """
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ExampleRMSNorm", "forward_native"]


def test_collect_env_lists_the_example_plugin():
    out = subprocess.run(
        [sys.executable, "-m", "xlm.entrypoints.cli", "collect-env", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    platform_eps = {ep["name"]: ep for ep in info["plugins"]["xlm.platform_plugins"]}
    general_eps = {ep["name"] for ep in info["plugins"]["xlm.general_plugins"]}
    assert platform_eps["oot_example"]["value"] == "xlm_oot_example:detect_platform"
    assert platform_eps["oot_example"]["distribution"] == "xlm-oot-example"
    assert "oot_example_ops" in general_eps
    assert info["platform"] == "CpuPlatform"
    assert info["packages"]["jax"]
