"""`xlm collect-env`: versions, the detected platform and devices, installed plugins."""

from __future__ import annotations

import argparse
import json
import platform as py_platform
import sys
from importlib import metadata
from typing import Any

from xlm import platforms
from xlm.config import ParallelConfig
from xlm.entrypoints import console
from xlm.jax_version import SUPPORTED_TEXT
from xlm.plugins import GENERAL_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP

PACKAGES = (
    "xlm",
    "jax",
    "jaxlib",
    # The accelerator plugins (the extras cuda, cuda12 and tpu install one).
    "jax-cuda13-plugin",
    "jax-cuda12-plugin",
    "libtpu",
    "flax",
    "numpy",
    "transformers",
    "tokenizers",
    "safetensors",
    "gguf",
    "torch",
    "fastapi",
    "pyzmq",
    "msgpack",
)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect_env(tensor_parallel_size: int | None = None) -> dict[str, Any]:
    """Gather the environment report as a dict (the mesh: over tp or all devices)."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "os": py_platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "supported_jax": SUPPORTED_TEXT,
    }
    plugins: dict[str, list[dict[str, str | None]]] = {}
    for group in (PLATFORM_PLUGINS_GROUP, GENERAL_PLUGINS_GROUP):
        plugins[group] = [
            {"name": ep.name, "value": ep.value, "distribution": ep.dist.name if ep.dist else None}
            for ep in metadata.entry_points(group=group)
        ]
    info["plugins"] = plugins
    try:
        info["platform"] = type(platforms.current_platform).__name__
        info["devices"] = [
            f"{d.platform}:{d.id} {d.device_kind}" for d in platforms.current_platform.devices()
        ]
        import jax

        from xlm.distributed.mesh import describe_mesh, make_mesh

        tp = tensor_parallel_size or len(jax.devices())
        mesh = make_mesh(ParallelConfig(tensor_parallel_size=tp))
        info["mesh"] = describe_mesh(mesh)
        info["mesh_devices"] = [f"{d.platform}:{d.id}" for d in mesh.devices.flat]
    except Exception as e:  # report, never crash: this command is for bug reports
        info["platform_error"] = f"{type(e).__name__}: {e}"
    return info


def _run(args: argparse.Namespace) -> int:
    info = collect_env(args.tensor_parallel_size)
    if args.json:
        console.out(json.dumps(info, indent=2))
        return 0
    console.out(f"Python: {info['python']}  ({info['os']})")
    for name, version in info["packages"].items():
        console.out(f"{name:>17}: {version or 'not installed'}")
    console.out(f"Supported jax: {info['supported_jax']}")
    console.out(f"Platform: {info.get('platform', info.get('platform_error'))}")
    for device in info.get("devices", []):
        console.out(f"  device {device}")
    if "mesh" in info:
        console.out(f"Mesh: {info['mesh']}: {' '.join(info['mesh_devices'])}")
    for group, entries in info["plugins"].items():
        console.out(f"Plugins [{group}]:" + ("" if entries else " none"))
        for ep in entries:
            console.out(f"  {ep['name']} = {ep['value']}  (from {ep['distribution']})")
    return 0


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="show the mesh of this tensor-parallel size (default: all devices)",
    )
    parser.set_defaults(func=_run)
