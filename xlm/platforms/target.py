"""Compile targets apart from the runtime devices: TPU slices described by libtpu, GPU nodes
by JAX's CUDA plugin, their chips' published figures, and the platform their programs are
built for.

`jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")`
(libtpu installed, no TPU needed) gives a slice's devices; programs lowered over a mesh
of them compile with the real TPU compiler (Mosaic included) and report their per-chip
memory and cost. Nothing is allocated: weights and KV caches are sharded
ShapeDtypeStructs. `xlm plan` (xlm.planning) is the user of this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jax.experimental import topologies

from xlm import envs, platforms
from xlm.platforms.cuda import CudaPlatform
from xlm.platforms.interface import Platform
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
    platform: str = "tpu"
    # GPUs: the XLA GpuDeviceInfoProto fields of the target configuration (the compiler
    # reads no device, so it must be told the SM count, shared memory, compute capability).
    gpu: tuple[tuple[str, Any], ...] = ()
    # The device-to-device copy bandwidth measured on such a chip, where one was: what
    # memory-bound code reaches, below the data sheet's figure. The estimates use it.
    copy_bytes_per_s: float | None = None
    copy_source: str = ""

    @property
    def bytes_per_s(self) -> float:
        """The bandwidth estimates divide by: measured where it was, else the data sheet's."""
        return self.copy_bytes_per_s or self.hbm_bytes_per_s


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


def _gpu(
    capability: tuple[int, int],
    sms: int,
    fpus: int,
    smem_sm: int,
    smem_optin: int,
    l2: int,
    clock_ghz: float,
) -> tuple:
    return (
        ("capability", capability),
        ("core_count", sms),
        ("fpus_per_core", fpus),
        ("shared_memory_per_core", smem_sm),
        ("shared_memory_per_block_optin", smem_optin),
        ("l2_cache_size", l2),
        ("clock_rate_ghz", clock_ghz),
    )


# NVIDIA's data sheets (H100 SXM5 80 GB, H200 SXM 141 GB, A100 SXM4 80 GB; dense bf16
# tensor-core peaks, i.e. without sparsity) and CUDA's per-architecture limits (SMs, shared
# memory per SM and per block opt-in, L2); memory is the device total nvidia-smi reports.
_MIB = 1 << 20
CHIPS.update(
    {
        "h100": Chip(
            "h100",
            81559 * _MIB,
            989e12,
            3.35e12,
            "nvidia.com/en-us/data-center/h100",
            "cuda",
            _gpu((9, 0), 132, 128, 233472, 232448, 50 * _MIB, 1.98),
        ),
        "h200": Chip(
            "h200",
            143771 * _MIB,
            989e12,
            4.8e12,
            "nvidia.com/en-us/data-center/h200",
            "cuda",
            _gpu((9, 0), 132, 128, 233472, 232448, 50 * _MIB, 1.98),
            copy_bytes_per_s=4.21e12,
            copy_source="torch copy_ of 2 GiB on an H200, 2026-11-28 (benchmarks/RESULTS.md, GPU)",
        ),
        "a100": Chip(
            "a100",
            81920 * _MIB,
            312e12,
            2.039e12,
            "nvidia.com/en-us/data-center/a100",
            "cuda",
            _gpu((8, 0), 108, 64, 167936, 166912, 40 * _MIB, 1.41),
        ),
    }
)


def gpu_target_config(chip: Chip) -> str:
    """The chip as a GpuTargetConfigProto (text), what XLA's GPU compiler needs in place
    of a device (the format of XLA's own xla/tools/hlo_opt/gpu_specs files)."""
    f = dict(chip.gpu)
    major, minor = f["capability"]
    return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {f["shared_memory_per_core"]}
  shared_memory_per_block_optin: {f["shared_memory_per_block_optin"]}
  threads_per_core_limit: 2048
  core_count: {f["core_count"]}
  fpus_per_core: {f["fpus_per_core"]}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bytes_per_s)}
  l2_cache_size: {f["l2_cache_size"]}
  clock_rate_ghz: {f["clock_rate_ghz"]}
  device_memory_size: {chip.hbm_bytes}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 patch: 0 }}
device_description_str: "NVIDIA {chip.name.upper()}"
"""


_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)$")
_GPU_NODE = re.compile(r"^(h100|h200|a100):([1-8])$")


@dataclass(frozen=True)
class CompileTarget:
    """A TPU slice or GPU node to compile for: its name, devices (abstract), chip, hosts."""

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
    """The slice or node named `topology`: a TPU slice ("v5e:2x2", "v6e:2x4", "v5p:2x2x1",
    "v5e:4x4", ...) or one GPU node ("h100:8", "h200:8", "a100:4")."""
    tpu, gpu = _TOPOLOGY.match(topology), _GPU_NODE.match(topology)
    if tpu is None and gpu is None:
        raise ValueError(
            f"target_topology={topology!r} is not a TPU slice or GPU node name: allowed "
            f"<tpu>:<dims> with tpu one of v4, v5e, v5p, v6e (e.g. v5e:2x2, v6e:2x4, "
            "v5p:2x2x1, v5e:4x4), or <gpu>:<1-8> with gpu one of h100, h200, a100"
        )
    if gpu is not None:
        return _gpu_target(topology, CHIPS[gpu.group(1)], int(gpu.group(2)))
    envs.allow_deviceless_libtpu()  # a plan beside a test run: both load libtpu
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:
        raise ValueError(
            f"target_topology={topology!r} could not be described by libtpu ({e}); install "
            "the TPU compiler with pip install 'jax[tpu]==<your jax version>'"
        ) from e
    return CompileTarget(topology, CHIPS[tpu.group(1)], tuple(desc.devices))


def _gpu_target(topology: str, chip: Chip, count: int) -> CompileTarget:
    try:
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=gpu_target_config(chip), topology=f"1x1x{count}"
        )
    except Exception as e:
        raise ValueError(
            f"target_topology={topology!r} could not be described by JAX's CUDA plugin "
            f"({e}); install it with pip install 'jax[cuda12]==<your jax version>' and run "
            "with JAX_PLATFORMS=cpu (no GPU is needed)"
        ) from e
    # JAX gives a process XLA_PYTHON_CLIENT_MEM_FRACTION of a GPU's memory (0.75 unless
    # set): that is the memory the engine would see there, so it is what is planned.
    usable = dataclasses.replace(chip, hbm_bytes=int(chip.hbm_bytes * envs.gpu_memory_fraction()))
    return CompileTarget(topology, usable, tuple(desc.devices))


class _OnTarget:
    """A platform whose devices are a compile target's (abstract) and whose memory is the
    chip's; nothing runs on it."""

    target: CompileTarget

    def devices(self) -> list[Any]:
        return list(self.target.devices)

    def get_device_name(self, device_id: int = 0) -> str:
        return self.target.device_kind

    def get_device_memory_stats(self, device_id: int = 0) -> dict[str, Any]:
        return {"bytes_limit": self.target.chip.hbm_bytes}


class TargetTpuPlatform(_OnTarget, TpuPlatform):
    """A TPU slice's platform: the Mosaic kernel and TPU defaults."""

    def __init__(self, target: CompileTarget) -> None:
        self.target = target


class TargetCudaPlatform(_OnTarget, CudaPlatform):
    """A GPU node's platform: the Triton kernel and GPU defaults."""

    def __init__(self, target: CompileTarget) -> None:
        self.target = target


@contextlib.contextmanager
def compiling_for(target: CompileTarget) -> Iterator[Platform]:
    """Make the target's platform the current one (op dispatch, dtype and config
    defaults follow it) while a plan builds and compiles its programs."""
    cls = TargetCudaPlatform if target.chip.platform == "cuda" else TargetTpuPlatform
    platform = cls(target)
    previous = platforms.swap_current_platform(platform)
    try:
        yield platform
    finally:
        platforms.swap_current_platform(previous)
