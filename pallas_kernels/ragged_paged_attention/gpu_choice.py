"""Which Pallas GPU kernel suits a jax version and a GPU: a pure function, not yet used by xlm.

jax 0.11 deprecates Pallas' Triton backend; Mosaic GPU (TMA, wgmma) needs Hopper (sm_90) or
newer. Before 0.11, or on older GPUs, the Triton kernel stays.
"""

from __future__ import annotations

import re
from typing import Literal

_MOSAIC_GPU_JAX = (0, 11)
_MOSAIC_GPU_CAPABILITY = (9, 0)


def _numbers(text: str, what: str, count: int) -> tuple[int, ...]:
    """The leading `count` dot-separated integers of `text` ("0.11.0rc1" -> (0, 11))."""
    match = re.match(r"^\s*(\d+(?:\.\d+)*)", text)
    if match is None:
        raise ValueError(f"{what}={text!r} does not start with a dotted version number")
    parts = [int(p) for p in match.group(1).split(".")]
    return tuple((parts + [0] * count)[:count])


def choose_gpu_kernel(
    jax_version: str | tuple[int, ...], compute_capability: str | tuple[int, int]
) -> Literal["triton", "mosaic_gpu"]:
    """The kernel to use: "mosaic_gpu" on sm_90+ with jax >= 0.11, "triton" otherwise.

    `jax_version` as jax.__version__ ("0.11.0", "0.11.1.dev20260101") or a tuple;
    `compute_capability` as a CUDA device reports it ("9.0", "10.0") or a (major, minor) tuple.
    """
    if isinstance(jax_version, str):
        jax_version = _numbers(jax_version, "jax_version", 2)
    if isinstance(compute_capability, str):
        compute_capability = _numbers(compute_capability, "compute_capability", 2)
    new_jax = tuple(jax_version[:2]) >= _MOSAIC_GPU_JAX
    hopper = tuple(compute_capability[:2]) >= _MOSAIC_GPU_CAPABILITY
    return "mosaic_gpu" if new_jax and hopper else "triton"
