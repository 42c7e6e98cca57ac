"""Compile targets apart from the runtime devices: TPU slices described by libtpu, their
chips' published figures, and the platform their programs are built for.

`jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")`
(libtpu installed, no TPU needed) gives a slice's devices; programs lowered over a mesh
of them compile with the real TPU compiler (Mosaic included) and report their per-chip
memory and cost. Nothing is allocated: weights and KV caches are sharded
ShapeDtypeStructs. `xlm plan` (xlm.worker.planner) is the user of this module.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jax.experimental import topologies

from xlm import platforms
from xlm.platforms.tpu import TpuPlatform

GiB = 1 << 30


@dataclass(frozen=True)
class Chip:
    """One device's figures: HBM the compiler lets programs use, and published dense bf16
    peak and HBM bandwidth."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    source: str


def _gib(x: float) -> int:
    return int(x * GiB)


# HBM: the "available HBM" the TPU compiler (libtpu 0.0.42.1) reports for one device when a
# program exceeds it (the spec's 16/32/95 GiB less the runtime's reserve). Peaks and
# bandwidth: Google Cloud's TPU system-architecture pages (cloud.google.com/tpu/docs/
# <name>), read 2026-11. libtpu describes a v4 slice per TensorCore (two devices per chip,
# no megacore), so v4's figures are half a chip's.
CHIPS: dict[str, Chip] = {
    "v4": Chip(
        "v4", _gib(15.25), 275e12 / 2, 1228e9 / 2, "cloud.google.com/tpu/docs/v4 (per core)"
    ),
    "v5e": Chip("v5e", _gib(15.75), 197e12, 819e9, "cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", _gib(95.74), 459e12, 2765e9, "cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", _gib(31.25), 918e12, 1640e9, "cloud.google.com/tpu/docs/v6e"),
}

_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)$")


@dataclass(frozen=True)
class CompileTarget:
    """A TPU slice to compile for: its name, devices (abstract), chip and hosts."""

    topology: str
    chip: Chip
    devices: tuple[Any, ...]

    @property
    def num_hosts(self) -> int:
        return len({d.process_index for d in self.devices})

    @property
    def devices_per_host(self) -> int:
        return len(self.devices) // self.num_hosts

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind


@functools.cache
def compile_target(topology: str) -> CompileTarget:
    """The slice named `topology` ("v5e:2x2", "v6e:2x4", "v5p:2x2x1", "v5e:4x4", ...)."""
    match = _TOPOLOGY.match(topology)
    if match is None:
        raise ValueError(
            f"target_topology={topology!r} is not a TPU slice name: allowed "
            f"<chip>:<dims> with chip one of {sorted(CHIPS)} (e.g. v5e:2x2, v6e:2x4, "
            "v5p:2x2x1, v5e:4x4)"
        )
    # libtpu warns about a missing TPU host environment; deviceless compiles need none.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "")
    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) meant for processes that own
    # TPU chips; compiling owns none, so several processes (a plan beside a test run) may.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:
        raise ValueError(
            f"target_topology={topology!r} could not be described by libtpu ({e}); install "
            "the TPU compiler with pip install 'jax[tpu]==<your jax version>'"
        ) from e
    return CompileTarget(topology, CHIPS[match.group(1)], tuple(desc.devices))


class TargetTpuPlatform(TpuPlatform):
    """The TPU platform of a compile target: its devices are the slice's (abstract), its
    memory the chip's published HBM; nothing runs on it."""

    def __init__(self, target: CompileTarget) -> None:
        self.target = target

    def devices(self) -> list[Any]:
        return list(self.target.devices)

    def get_device_name(self, device_id: int = 0) -> str:
        return self.target.device_kind

    def get_device_memory_stats(self, device_id: int = 0) -> dict[str, Any]:
        return {"bytes_limit": self.target.chip.hbm_bytes}


@contextlib.contextmanager
def compiling_for(target: CompileTarget) -> Iterator[TargetTpuPlatform]:
    """Make the target's platform the current one (op dispatch, dtype and config
    defaults follow it) while a plan builds and compiles its programs."""
    platform = TargetTpuPlatform(target)
    previous = platforms.swap_current_platform(platform)
    try:
        yield platform
    finally:
        platforms.swap_current_platform(previous)
