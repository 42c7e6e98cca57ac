"""`xlm collect-env`: the report's versions, plugins, devices and mesh agree with what
Python, importlib.metadata and JAX say directly; a broken platform is reported, never
raised (the CLI with an installed plugin: tests/platforms/test_plugin_e2e.py)."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata

import jax

from xlm import platforms
from xlm.entrypoints import collect_env as module
from xlm.entrypoints.collect_env import PACKAGES, add_parser, collect_env
from xlm.jax_version import SUPPORTED_TEXT
from xlm.plugins import GENERAL_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP


def test_collect_env_shows_the_mesh():
    info = collect_env(tensor_parallel_size=1)
    assert info["mesh"].startswith("mesh (data=1, model=1) of 1 ")
    assert "1 process(es)" in info["mesh"] and len(info["mesh_devices"]) == 1


def test_the_report_agrees_with_python_metadata_and_jax():
    info = collect_env()
    assert info["python"] == sys.version.split()[0]
    assert set(info["packages"]) == set(PACKAGES)
    assert info["packages"]["jax"] == metadata.version("jax") == jax.__version__
    assert info["packages"]["numpy"] == metadata.version("numpy")
    assert info["packages"]["libtpu"] == metadata.version("libtpu")  # the test extra's
    assert info["supported_jax"] == SUPPORTED_TEXT
    for group in (PLATFORM_PLUGINS_GROUP, GENERAL_PLUGINS_GROUP):
        names = sorted(ep["name"] for ep in info["plugins"][group])
        assert names == sorted(ep.name for ep in metadata.entry_points(group=group))
    assert info["platform"] == type(platforms.current_platform).__name__
    devices = platforms.current_platform.devices()
    assert info["devices"] == [f"{d.platform}:{d.id} {d.device_kind}" for d in devices]
    assert len(info["mesh_devices"]) == len(jax.devices())  # over every device by default
    assert "platform_error" not in info


def test_a_failing_platform_is_reported_not_raised(monkeypatch):
    class Broken:
        def devices(self):
            raise RuntimeError("no backend")

    # The resolved-platform cache, not the module attribute: setting that would leave a real
    # attribute behind on undo, and later lookups would no longer resolve lazily.
    monkeypatch.setattr(platforms, "_current_platform", Broken())
    info = collect_env()
    assert info["platform_error"] == "RuntimeError: no backend"
    assert "devices" not in info and info["packages"]["jax"]


def _cli(argv, capsys) -> str:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(), "collect-env", "")
    args = parser.parse_args(["collect-env", *argv])
    assert args.func is module._run and args.func(args) == 0
    return capsys.readouterr().out


def test_the_command_prints_json_or_text(capsys):
    info = json.loads(_cli(["--json", "-tp", "1"], capsys))
    assert info["packages"]["jax"] == jax.__version__ and len(info["mesh_devices"]) == 1
    text = _cli([], capsys)
    assert f"Python: {sys.version.split()[0]}" in text
    assert f"{'jax':>17}: {jax.__version__}" in text
    assert f"Supported jax: {SUPPORTED_TEXT}" in text
    assert f"Platform: {type(platforms.current_platform).__name__}" in text
    assert "Mesh: mesh (data=1" in text
