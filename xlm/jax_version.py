"""The jax versions xlm supports, checked when xlm is imported (without importing jax).

Tested: jax 0.10.2 (CI on CPU; TPU programs compiled with libtpu) and jax 0.11.2 (an
NVIDIA H200 with the CUDA 13 plugin, benchmarks/RESULTS.md "GPU"). Outside this range xlm
stops at import with what to install, rather than failing later inside a compile.
"""

from __future__ import annotations

import re
from importlib import metadata

import xlm.envs as envs  # not `from xlm import`: the root imports this module

SUPPORTED = ((0, 10), (0, 12))  # [lowest, first unsupported), by (major, minor)
SUPPORTED_TEXT = "jax>=0.10,<0.12"
SKIP_VARIABLE = "XLM_SKIP_JAX_VERSION_CHECK"


def unsupported_reason(version: str) -> str | None:
    """Why `version` of jax is refused, or None when it is in the supported range."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return None  # a development build without a plain version: let it run
    found = (int(match.group(1)), int(match.group(2)))
    low, high = SUPPORTED
    if low <= found < high:
        return None
    return (
        f"xlm supports {SUPPORTED_TEXT} (tested on 0.10.2 and 0.11.2); found jax {version}. "
        f"Install a supported one: pip install '{SUPPORTED_TEXT}' (or xlm[cuda] / xlm[tpu], "
        f"which pin the accelerator plugin to its jax), or set {SKIP_VARIABLE}=1 to try "
        "this one anyway."
    )


def check_jax_version() -> None:
    """Raise ImportError naming the supported range when the installed jax is outside it."""
    if envs.XLM_SKIP_JAX_VERSION_CHECK:
        return
    try:
        version = metadata.version("jax")
    except metadata.PackageNotFoundError:
        return  # importing jax will say so
    reason = unsupported_reason(version)
    if reason is not None:
        raise ImportError(reason)
