"""The Platform interface: what xlm needs to know about a device family."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

    from xlm.config import XlmConfig


class PlatformEnum(enum.Enum):
    TPU = enum.auto()
    CUDA = enum.auto()
    ROCM = enum.auto()
    CPU = enum.auto()
    OOT = enum.auto()
    UNSPECIFIED = enum.auto()


class Platform:
    """A device family: its JAX backend, its devices, and the defaults it imposes."""

    _enum: PlatformEnum
    # Human name ("cpu", "cuda", ...) and the device type the user sees.
    device_name: str
    device_type: str
    # The backend name given to jax.devices(); None: JAX's default backend.
    jax_platform: str | None = None
    # Whether bfloat16 runs fast here; else float32 is the "auto" dtype.
    supports_fast_bf16: bool = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_name={self.device_name!r})"

    def is_tpu(self) -> bool:
        return self._enum == PlatformEnum.TPU

    def is_cuda(self) -> bool:
        return self._enum == PlatformEnum.CUDA

    def is_rocm(self) -> bool:
        return self._enum == PlatformEnum.ROCM

    def is_cpu(self) -> bool:
        return self._enum == PlatformEnum.CPU

    def is_out_of_tree(self) -> bool:
        return self._enum == PlatformEnum.OOT

    # Device queries initialize the JAX backend: call them only when devices are needed.
    def devices(self) -> list[jax.Device]:
        """The local devices of this platform's JAX backend."""
        import jax

        return jax.local_devices(backend=self.jax_platform)

    def device_count(self) -> int:
        return len(self.devices())

    def get_device_name(self, device_id: int = 0) -> str:
        return self.devices()[device_id].device_kind

    def get_device_memory_stats(self, device_id: int = 0) -> dict[str, Any]:
        """Memory stats of one device ({} where the backend reports none)."""
        return self.devices()[device_id].memory_stats() or {}

    def get_device_total_memory(self, device_id: int = 0) -> int | None:
        return self.get_device_memory_stats(device_id).get("bytes_limit")

    def get_device_free_memory(self, device_id: int = 0) -> int | None:
        stats = self.get_device_memory_stats(device_id)
        if "bytes_limit" not in stats:
            return None
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)

    def pin_jax_backend(self) -> None:
        """Make this platform's JAX backend the one JAX uses (XLM_TARGET_PLATFORM)."""
        if self.jax_platform is None:
            return
        import jax

        # Before JAX starts its backends this keeps the others from starting at all; the
        # default device covers a process whose backends are already up. Neither starts a
        # backend now (jax.distributed must be able to initialize first).
        jax.config.update("jax_platforms", self.jax_platform)
        jax.config.update("jax_default_device", self.jax_platform)

    def check_and_update_config(self, config: XlmConfig) -> None:
        """Adjust a config to this platform (block size, buckets, ...); raise if unsupported."""

    def compiler_options(self) -> dict[str, Any]:
        """XLA options the step programs compile with on this platform (`jax.jit`'s
        compiler_options). None by default."""
        return {}

    def data_parallel_env(self, rank: int, tp: int) -> dict[str, str]:
        """Environment variables that show a data-parallel rank's process only its own
        `tp` devices (set in that process before JAX starts). None here: the rank's engine
        takes its group from all the devices it sees (`xlm.distributed.mesh.rank_devices`)."""
        return {}

    def data_parallel_cpus(self, rank: int, dp: int) -> set[int] | None:
        """CPU cores a data-parallel rank's process is pinned to (None: no pinning)."""
        return None


class UnspecifiedPlatform(Platform):
    """No platform activated: xlm can be imported but not run a model."""

    _enum = PlatformEnum.UNSPECIFIED
    device_name = "unspecified"
    device_type = "unspecified"
